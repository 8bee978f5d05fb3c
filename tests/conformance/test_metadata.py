"""Object metadata fetched once: what a HEAD said of an object version is kept by (key,
ETag, Last-Modified second) in the state database and with the key's owner in a cluster,
so a restarted node, or another node, answers `ls -l` from LISTs alone; a changed object
is still seen. Driven without FUSE on the in-memory store, counting its requests (the
real-mount proof is tests/integration/test_metadata_cache.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import trio

from objcache.core.inode import ROOT_INO
from tests.helpers.inproc import FaultyStore, Posix, cluster, config, node
from tests.helpers.memstore import MemoryStore

N = 300


def _bucket() -> MemoryStore:
    store = MemoryStore()
    for i in range(N):
        store.put(f"d/{i:04d}", b"x" * i, {"mode": str(stat.S_IFREG | 0o600), "uid": "7"})
    return store


async def _ls_l(p: Posix) -> list[int]:
    """readdir, then a stat of each entry (what `ls -l` asks the core); the modes."""
    d = (await p.fs.lookup(ROOT_INO, "d")).ino
    return [(await p.fs.lookup(d, name)).mode for name, _ in await p.fs.readdir(d)]


async def test_a_restarted_node_lists_without_a_head(tmp_path: Path) -> None:
    store = _bucket()
    async with node(config(), store, tmp_path / "n") as p:
        assert await _ls_l(Posix(p.fs)) == [stat.S_IFREG | 0o600] * N
        assert store.calls["head"] >= N - 1  # cold: S3 lists no metadata
    store.calls.clear()
    async with node(config(), store, tmp_path / "n") as p:
        assert await _ls_l(Posix(p.fs)) == [stat.S_IFREG | 0o600] * N
        assert (await Posix(p.fs).stat("d/0005")).uid == 7
    # one HEAD: the lookup of "d" itself (a file named d?), none for its files
    assert store.calls["head"] <= 1, store.calls
    assert store.calls["list"] == 1


async def test_another_node_lists_without_a_head(tmp_path: Path) -> None:
    store = _bucket()
    async with cluster(FaultyStore(store), tmp_path, 2) as (p0, p1):
        await _ls_l(Posix(p0.fs))
        await trio.sleep(1.2)  # the answers reach the keys' owners
        store.calls.clear()
        assert await _ls_l(Posix(p1.fs)) == [stat.S_IFREG | 0o600] * N
        assert store.calls["head"] <= 1, store.calls  # "d" itself
        assert p1.meta.from_peers > 0  # type: ignore[union-attr]


async def test_a_changed_object_is_seen_within_the_ttl(tmp_path: Path) -> None:
    store = _bucket()
    cfg = config(metadata_ttl=0.5)
    async with node(cfg, store, tmp_path / "n") as p:
        await _ls_l(Posix(p.fs))
        store.put("d/0005", b"new", {"mode": str(stat.S_IFREG | 0o640)})  # another client
        await trio.sleep(0.6)
        a = await Posix(p.fs).stat("d/0005")
        assert (stat.S_IMODE(a.mode), a.size) == (0o640, 3)
        modes = await _ls_l(Posix(p.fs))
        assert modes[5] == stat.S_IFREG | 0o640 and modes[4] == stat.S_IFREG | 0o600
    # and a restarted node does not take the old version's metadata for the new one
    store.put("d/0006", b"newer", {"mode": str(stat.S_IFREG | 0o604)})
    async with node(cfg, store, tmp_path / "n") as p:
        modes = await _ls_l(Posix(p.fs))
        assert modes[5] == stat.S_IFREG | 0o640 and modes[6] == stat.S_IFREG | 0o604
