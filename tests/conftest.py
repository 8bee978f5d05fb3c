from __future__ import annotations

import compileall
import itertools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import objcache
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, stop_all
from tests.helpers.s3proxy import CountingProxy
from tests.helpers.seaweed import SeaweedFS

_bucket_seq = itertools.count()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile objcache's bytecode once for the daemons and CLI runs the suite starts
    (~200 daemons, as many CLI runs). With PYTHONDONTWRITEBYTECODE set (as in the
    environment of this project's machines) Python never writes it, so every one of them
    compiled all of objcache again (0.1-0.15 s of CPU per daemon). Python reads existing
    bytecode whatever that variable says, and recompiles a module whose source is newer."""
    if sys.dont_write_bytecode:
        compileall.compile_dir(os.path.dirname(objcache.__file__), quiet=1)


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(seaweed: SeaweedFS):  # type: ignore[no-untyped-def]
    return seaweed.client()


@pytest.fixture
def bucket(seaweed: SeaweedFS, s3) -> str:  # type: ignore[no-untyped-def]
    name = f"t{os.getpid()}-{next(_bucket_seq)}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def mounts(seaweed: SeaweedFS, tmp_path: Path) -> Iterator[list[Mount]]:
    """Mounts created by a test; all of them are torn down whatever happens."""
    if not fuse_available():
        pytest.skip("needs /dev/fuse and fusermount3")
    made: list[Mount] = []
    yield made
    stop_all(made)


@pytest.fixture
def mount(mounts: list[Mount], seaweed: SeaweedFS, bucket: str, tmp_path: Path):  # type: ignore
    """A factory: mount(*extra_flags, cache=..., mnt=...) -> started Mount."""
    def make(*extra: str, cache: Path | None = None, mnt: Path | None = None,
             start: bool = True) -> Mount:
        m = Mount(seaweed.endpoint, bucket, mnt or tmp_path / "mnt",
                  cache or tmp_path / "cache", *extra)
        mounts.append(m)
        return m.start() if start else m
    return make


@pytest.fixture
def proxy(seaweed: SeaweedFS) -> Iterator[CountingProxy]:
    """A counting proxy in front of SeaweedFS: daemons that use it have their S3 traffic
    counted (object GETs and bytes)."""
    p = CountingProxy(seaweed.port).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def cluster(mounts: list[Mount], proxy: CountingProxy, bucket: str,
            tmp_path: Path) -> Cluster:
    return Cluster(proxy.endpoint, bucket, tmp_path, mounts)
