"""How the filesystem core asks S3 about files it only knows from a LIST (objcache/core/
filesystem.py): a stat storm in a listed directory is answered by background HEADs that
stay a bounded window ahead; a directory whose files are being read gets one GET per small
file (its metadata from the same response); names looked up one by one in an unlisted
directory end in one LIST. Driven without FUSE on the in-memory store, counting requests."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from objcache.backend.local import LocalBackend
from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.pins import Pins
from objcache.cache.quarantine import Quarantine
from objcache.cache.router import ChunkRouter
from objcache.cache.statedb import StateDB
from objcache.config import MountConfig
from objcache.core import filesystem
from objcache.core.filesystem import (
    META_PREFETCH,
    META_PREFETCH_WINDOW,
    META_READ_WINDOW,
    Filesystem,
)
from objcache.core.inode import ROOT_INO
from tests.helpers.memstore import MemoryStore

N = 2000


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[Filesystem, MemoryStore]]:
    store = MemoryStore()
    for i in range(N):
        store.put(f"d/{i:05d}", f"file {i}".encode() * 100)
    db = StateDB(tmp_path / "state.db")
    cfg = MountConfig(chunk_size=4 << 20, readahead=4 << 20)
    cache = ChunkCache(db, tmp_path, 1 << 30, cfg.chunk_size, store)  # type: ignore[arg-type]
    router = ChunkRouter(cache, Pins(cache))
    local = LocalFiles(db, tmp_path, cache, router)
    fs = Filesystem(cfg, LocalBackend(cfg, store, local, Quarantine(tmp_path)), router,  # type: ignore[arg-type]
                    local)
    store.delay = 0.001
    async with trio.open_nursery() as n:
        await n.start(cache.run)
        await n.start(fs.run)
        yield fs, store
        n.cancel_scope.cancel()


async def _listed_dir(fs: Filesystem) -> int:
    ino = (await fs.lookup(ROOT_INO, "d")).ino
    await fs.readdir(ino)
    return ino


async def test_stat_storm_is_prefetched_within_a_window(env) -> None:  # type: ignore
    fs, store = env
    d = await _listed_dir(fs)
    store.calls.clear()
    for i in range(10):  # `ls -l`: a lookup per entry, in listing order
        attr = await fs.lookup(d, f"{i:05d}")
        assert attr.size == len(f"file {i}".encode() * 100)
    await trio.sleep(0.5)
    # ahead of the caller, but not the whole directory for ten stats
    assert 10 + META_PREFETCH <= store.calls["head"] <= 10 + META_PREFETCH_WINDOW + \
        META_PREFETCH
    assert store.calls["get"] == 0  # stat only: nothing downloaded
    for i in range(10, N):
        await fs.lookup(d, f"{i:05d}")
    assert store.calls["head"] == N  # each file asked about exactly once


async def test_random_stats_cost_one_head_each(env) -> None:  # type: ignore
    """Stats in no order (a job picking random samples) are not a sweep: no HEAD ahead,
    at most 1.1 requests per stat, over a big listed directory and over small ones."""
    fs, store = env
    d = await _listed_dir(fs)
    rng = random.Random(7)
    picks = rng.sample(range(N), 600)
    store.calls.clear()
    for i in picks:
        await fs.lookup(d, f"{i:05d}")
    await trio.sleep(0.3)
    assert store.calls["head"] <= 1.1 * len(picks), store.calls
    for j in range(40):  # 40 directories of 50 entries, 6 random stats in each
        for k in range(50):
            store.put(f"e{j}/{k:02d}", b"x")
    store.calls.clear()
    stats = 0
    for j in range(40):
        e = (await fs.lookup(ROOT_INO, f"e{j}")).ino
        await fs.readdir(e)
        for k in rng.sample(range(50), 6):
            await fs.lookup(e, f"{k:02d}")
            stats += 1
    await trio.sleep(0.3)
    heads = store.calls["head"] + store.calls["list"] - 40  # a LIST per directory
    assert heads <= 1.1 * stats + 40, store.calls  # (+ the directories' own lookups)


async def test_files_being_read_cost_one_get_each(env) -> None:  # type: ignore
    fs, store = env
    d = await _listed_dir(fs)
    store.calls.clear()
    for i in range(50):
        attr = await fs.lookup(d, f"{i:05d}")
        fh, _, _ = await fs.open(attr.ino, os.O_RDONLY)
        assert await fs.read(fh, 0, 1 << 20) == f"file {i}".encode() * 100
        await fs.release(fh)
    assert store.calls["head"] <= 1  # the first lookup, before any file was opened
    await trio.sleep(0.5)
    # nobody reads on: the prefetch stops a short window ahead of the reader
    assert 50 + META_PREFETCH <= store.calls["get"] <= 50 + META_READ_WINDOW + META_PREFETCH


async def test_names_looked_up_in_an_unlisted_directory_end_in_one_list(env) -> None:  # type: ignore
    fs, store = env
    d = (await fs.lookup(ROOT_INO, "d")).ino
    store.calls.clear()
    for i in range(200):
        await fs.lookup(d, f"{i:05d}")
    assert store.calls["list"] == 1
    assert store.calls["head"] <= 200 + META_PREFETCH_WINDOW + META_PREFETCH
    with pytest.raises(Exception, match="missing"):
        await fs.lookup(d, "missing")
    assert store.calls["list"] == 1  # the fresh listing answers misses too


async def test_a_forgotten_directory_keeps_its_files_metadata(env) -> None:  # type: ignore
    # drop_caches or memory pressure: the kernel forgets the directory and its files; the
    # next pass over them must not HEAD every file again
    fs, store = env
    d = await _listed_dir(fs)
    inos = [(await fs.lookup(d, f"{i:05d}")).ino for i in range(100)]
    fs.forget([(ino, 1) for ino in inos] + [(d, 1)])
    store.calls.clear()
    d2 = (await fs.lookup(ROOT_INO, "d")).ino
    for i in range(100):
        await fs.lookup(d2, f"{i:05d}")
    assert store.calls["head"] == 0 and store.calls["list"] == 0, store.calls


async def test_a_failing_prefetch_is_logged_and_the_stats_still_answer(
        env, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # An unexpected error in the background batch once took the whole mount down.
    fs, store = env
    d = await _listed_dir(fs)

    async def broken(keys, each):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected: the batch path broke")

    store.head_many = broken
    store.calls.clear()
    for i in range(40):
        attr = await fs.lookup(d, f"{i:05d}")
        assert attr.size == len(f"file {i}".encode() * 100)
    await trio.sleep(0.2)
    assert "metadata prefetch in 'd' failed" in caplog.text
    assert store.calls["head"] == 40  # each stat asked for itself


async def test_a_pause_for_waste_ends(env, monkeypatch) -> None:  # type: ignore
    """Prefetching that fetched mostly what nobody asked for pauses; the pause ends after
    META_WASTE_PAUSE even if nothing was prefetched since (it never did: a cold `ls -l` of
    10,000 entries on a WAN-like S3 then paid one round trip per entry, 272 s)."""
    fs, store = env
    monkeypatch.setattr(filesystem, "META_WASTE_PAUSE", 0.3, raising=False)
    fs._prefetched, fs._prefetch_wasted = 1000, 900  # an earlier, wasteful sweep
    d = await _listed_dir(fs)
    store.calls.clear()
    for i in range(20):
        await fs.lookup(d, f"{i:05d}")
    await trio.sleep(0.2)
    assert store.calls["head"] == 20  # paused: one HEAD per stat, none ahead
    await trio.sleep(0.2)
    for i in range(20, 40):
        await fs.lookup(d, f"{i:05d}")
    await trio.sleep(0.3)
    assert store.calls["head"] >= 40 + META_PREFETCH  # going ahead of the stats again


async def test_a_prefetch_ahead_of_slow_readers_waits_for_them(env) -> None:  # type: ignore
    """A sweep of stats starts the prefetch with the stat window; once the files are
    being read the window is shorter, so the prefetch is further ahead than it may go and
    waits for the readers. Each step a reader makes must not end it: it did, and the
    entries it had fetched ahead counted as waste, which paused prefetching for the next
    sweep too (a cold `ls -l` of 10,000 entries on a WAN-like S3 took 27 s instead of 6 s,
    in 3 of 12 runs)."""
    fs, store = env
    d = await _listed_dir(fs)
    for i in range(10):  # `ls -l` over the start of it
        await fs.lookup(d, f"{i:05d}")
    await trio.sleep(0.3)
    assert store.calls["head"] >= META_PREFETCH_WINDOW  # well ahead
    for i in range(10, 10 + 2 * META_READ_WINDOW):  # then a slow reader goes through
        attr = await fs.lookup(d, f"{i:05d}")
        fh, _, _ = await fs.open(attr.ino, os.O_RDONLY)
        await fs.read(fh, 0, 1 << 20)
        await fs.release(fh)
        await trio.sleep(0.002)
    assert d in fs._meta_prefetching  # still there for the rest of the sweep
    assert fs._prefetch_wasted == 0 and not fs._prefetch_wasteful()


async def test_a_relist_for_stale_lookups_keeps_the_directory_being_read(env) -> None:  # type: ignore
    """Readers' lookups that went stale relist the directory; its files are still being
    read, so the small ones stay one GET each (a relist that forgot it made every lookup
    and the prefetch HEAD the files their opens then GET)."""
    fs, store = env
    d = await _listed_dir(fs)
    for i in range(3):
        attr = await fs.lookup(d, f"{i:05d}")
        fh, _, _ = await fs.open(attr.ino, os.O_RDONLY)
        await fs.release(fh)
    inode = fs.inodes[d]
    reading = inode.read_children
    assert reading >= 3
    inode.listed -= fs.ttl + 1  # the listing went stale while the files were read
    await fs._relist(inode)
    assert inode.read_children == reading
    store.calls.clear()
    await fs.lookup(d, f"{N - 1:05d}")  # a file not read yet: fetched whole, no HEAD
    assert store.calls["head"] == 0 and store.calls["get"] >= 1
