"""The core's handling of a key the backend no longer knows the fate of (`Change.resync`:
a node behind the cluster's log took a snapshot in which the key's entry is gone, and only
S3 can say whether the key was written back or removed; the partition nemesis with
learners, seed 4309). What the core knew of the key is forgotten and the kernel's entry
dropped, so the next lookup asks again; a handle open on the file keeps its inode."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from objcache.backend.base import Change
from objcache.backend.local import LocalBackend
from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.pins import Pins
from objcache.cache.quarantine import Quarantine
from objcache.cache.router import ChunkRouter
from objcache.cache.statedb import StateDB
from objcache.config import MountConfig
from objcache.core.filesystem import Filesystem, NoNotifier
from objcache.core.inode import ROOT_INO
from objcache.errors import StaleObject
from tests.helpers.memstore import MemoryStore


class Told(NoNotifier):
    def __init__(self) -> None:
        self.entries: list[tuple[int, str]] = []

    def entry(self, parent_ino: int, name: str) -> None:
        self.entries.append((parent_ino, name))


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[Filesystem, MemoryStore, Told]]:
    store = MemoryStore()
    store.put("d/f", b"old bytes")
    store.put("d/g", b"other")
    db = StateDB(tmp_path / "state.db")
    cfg = MountConfig(chunk_size=4 << 20, readahead=4 << 20)
    cache = ChunkCache(db, tmp_path, 1 << 30, cfg.chunk_size, store)  # type: ignore[arg-type]
    router = ChunkRouter(cache, Pins(cache))
    local = LocalFiles(db, tmp_path, cache, router)
    told = Told()
    fs = Filesystem(cfg, LocalBackend(cfg, store, local, Quarantine(tmp_path)),  # type: ignore[arg-type]
                    router, local, told)
    async with trio.open_nursery() as n:
        await n.start(cache.run)
        await n.start(fs.run)
        yield fs, store, told
        n.cancel_scope.cancel()


async def test_a_resynced_key_is_looked_up_again_and_open_handles_keep_their_file(
        env) -> None:  # type: ignore[no-untyped-def]
    fs, store, told = env
    d = (await fs.lookup(ROOT_INO, "d")).ino
    await fs.readdir(d)
    f = (await fs.lookup(d, "f")).ino
    g = (await fs.lookup(d, "g")).ino
    fh, _, _ = await fs.open(f, 0)
    assert bytes(await fs.read(fh, 0, 100)) == b"old bytes"  # (cached: S3 keeps no old one)
    parent = fs.inodes[d]
    assert parent.children is not None and "f" in parent.children

    store.put("d/f", b"what S3 holds now")  # (written back by another node meanwhile)
    fs._apply_changes([Change("d/f", None, resync=True)])

    assert (d, "f") in told.entries  # the kernel's entry goes
    assert "f" not in parent.children and parent.listed == 0.0  # listed again
    assert "g" in parent.children and fs.inodes[g].key == "d/g"  # its sibling stays
    assert fs.inodes[f].detached  # the open handle keeps its inode...
    assert bytes(await fs.read(fh, 0, 100)) == b"old bytes"  # ...and its version
    again = await fs.lookup(d, "f")  # the next lookup asks again: a new inode
    assert again.ino != f and again.size == len(b"what S3 holds now")
    await fs.release(fh)


async def test_a_name_the_kernel_still_shows_for_a_detached_inode_is_stale(
        env) -> None:  # type: ignore[no-untyped-def]
    # The partition nemesis, seed 5404: a learner applied a batch that gave `reg/k0` a new
    # inode; the kernel, before the entry's invalidation reached it, opened the name it had
    # looked up, and its GETATTR of the old inode answered ENOENT: the open failed for a
    # file that exists. ESTALE makes the kernel look the name up again.
    fs, store, told = env
    d = (await fs.lookup(ROOT_INO, "d")).ino
    f = (await fs.lookup(d, "f")).ino
    store.put("d/f", b"what S3 holds now")
    fs._apply_changes([Change("d/f", None, resync=True)])
    assert fs.inodes[f].detached and fs.inodes[f].lookups == 1  # the kernel's reference
    with pytest.raises(StaleObject):
        await fs.getattr(f)
    again = await fs.lookup(d, "f")
    assert again.ino != f and (await fs.getattr(again.ino)).size == len(b"what S3 holds now")


async def test_a_name_that_shows_another_inode_after_a_head_is_stale(
        env) -> None:  # type: ignore[no-untyped-def]
    # A new version in S3 while passthrough opens keep the old one: the name gets a new
    # inode. The GETATTR that found it answered ENOENT, and a stat or an open of the name
    # failed once for a file that exists.
    fs, store, told = env
    d = (await fs.lookup(ROOT_INO, "d")).ino
    f = (await fs.lookup(d, "f")).ino
    old = fs.inodes[f]
    await fs.getattr(f)
    old.backed = object()  # (as while passthrough opens hold its backing file)
    old.checked = 0.0  # (its attributes are due a HEAD)
    store.put("d/f", b"a new version")
    with pytest.raises(StaleObject):
        await fs.getattr(f)
    again = await fs.lookup(d, "f")
    assert again.ino != f and again.size == len(b"a new version")
