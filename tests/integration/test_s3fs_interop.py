"""A bucket reads the same through objcache and s3fs-fuse, both ways: file types (FIFOs,
sockets, devices, symlinks), modes, owners and the three times, as object metadata in
s3fs's convention. Also checks that what objcache wrote survives a remount (a new cache
dir: everything comes from S3)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import fuse_available
from tests.helpers.mount import Mount, objcache
from tests.helpers.s3fs import s3fs_mount
from tests.helpers.seaweed import SeaweedFS

pytestmark = pytest.mark.skipif(
    not fuse_available() or shutil.which("s3fs") is None,
    reason="needs FUSE and s3fs-fuse (scripts/setup.sh installs it)")

ATIME = 1_500_000_000_123_456_789
MTIME = 1_600_000_000_987_654_321


def _mount(seaweed: SeaweedFS, bucket: str, work: Path, name: str) -> Mount:
    return Mount(seaweed.endpoint, bucket, work / f"mnt-{name}", work / f"cache-{name}",
                 "--writeback-delay", "3600").start()


def test_s3fs_wrote_objcache_reads(seaweed: SeaweedFS, bucket: str, tmp_path: Path) -> None:
    with s3fs_mount(seaweed.endpoint, bucket, tmp_path) as m:
        os.mkfifo(m / "fifo", 0o640)
        os.mknod(m / "sock", stat.S_IFSOCK | 0o600)
        (m / "f").write_bytes(b"s3fs data")
        os.chmod(m / "f", 0o600)
        os.utime(m / "f", ns=(ATIME, MTIME))
        os.symlink("f", m / "ln")
        # (SeaweedFS keeps no metadata on keys ending in "/": a directory's mode, owner
        # and times do not survive it, whoever writes them; AWS S3 and MinIO keep them.)
        want = {n: os.lstat(m / n) for n in ("fifo", "sock", "f", "ln")}
    ours = _mount(seaweed, bucket, tmp_path, "a")
    try:
        for n, w in want.items():
            st = os.lstat(ours.mnt / n)
            assert st.st_mode == w.st_mode, (n, oct(st.st_mode), oct(w.st_mode))
            assert (st.st_uid, st.st_gid) == (w.st_uid, w.st_gid), n
            assert st.st_mtime_ns == w.st_mtime_ns, n
            assert st.st_atime_ns == w.st_atime_ns, n
            assert st.st_ctime_ns == w.st_ctime_ns, n
        assert (ours.mnt / "f").read_bytes() == b"s3fs data"
        assert os.readlink(ours.mnt / "ln") == "f"
        assert not ours.errors_in_log()
    finally:
        ours.stop()


def test_objcache_wrote_s3fs_and_a_remount_read(seaweed: SeaweedFS, bucket: str,
                                               tmp_path: Path) -> None:
    ours = _mount(seaweed, bucket, tmp_path, "a")
    try:
        m = ours.mnt
        os.mkfifo(m / "fifo", 0o640)
        os.mknod(m / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        (m / "f").write_bytes(b"objcache data")
        os.chmod(m / "f", 0o600)
        os.utime(m / "f", ns=(ATIME, MTIME))
        os.symlink("f", m / "ln")
        (m / "d").mkdir(mode=0o750)
        want = {n: os.lstat(m / n) for n in ("fifo", "chr", "f", "ln")}
        objcache("flush", str(m))
    finally:
        ours.stop()
    again = _mount(seaweed, bucket, tmp_path, "b")  # a fresh cache dir: all from S3
    try:
        for n, w in want.items():
            st = os.lstat(again.mnt / n)
            assert (st.st_mode, st.st_uid, st.st_gid, st.st_rdev) == \
                (w.st_mode, w.st_uid, w.st_gid, w.st_rdev), n
            assert (st.st_mtime_ns, st.st_atime_ns, st.st_ctime_ns) == \
                (w.st_mtime_ns, w.st_atime_ns, w.st_ctime_ns), n
        assert (again.mnt / "f").read_bytes() == b"objcache data"
        assert (again.mnt / "d").is_dir()
    finally:
        again.stop()
    with s3fs_mount(seaweed.endpoint, bucket, tmp_path) as s:
        for n, w in want.items():
            st = os.lstat(s / n)
            assert st.st_mode == w.st_mode, (n, oct(st.st_mode), oct(w.st_mode))
            assert (st.st_uid, st.st_gid) == (w.st_uid, w.st_gid), n
            assert st.st_mtime_ns == w.st_mtime_ns, n
        st = os.lstat(s / "f")
        assert (st.st_atime_ns, st.st_ctime_ns) == (ATIME, want["f"].st_ctime_ns)
        assert (s / "f").read_bytes() == b"objcache data"
        assert os.readlink(s / "ln") == "f"
