"""Chunk cache and write-back store logic, on an in-memory object store: single-flight
streaming downloads, LRU within the capacity, checksums, the working-copy overlay."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from objcache.cache.chunks import PIECE, ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.pins import Pins
from objcache.cache.router import ChunkRouter
from objcache.cache.statedb import StateDB
from objcache.core.handles import ObjectSource
from objcache.entries import Attrs, ObjectRef
from objcache.errors import NoSpace
from tests.helpers.memstore import MemoryStore

CS = 5 << 20
PIECES = -(-CS // PIECE)  # ranged GETs per whole chunk


@asynccontextmanager
async def running(tmp_path: Path, store: MemoryStore, capacity: int = 100 << 20
                  ) -> AsyncIterator[tuple[StateDB, ChunkRouter, LocalFiles]]:
    """(db, the chunk router over its running cache, the local files)."""
    db = StateDB(tmp_path / "state.db")
    cache = ChunkCache(db, tmp_path, capacity, CS, store)  # type: ignore[arg-type]
    router = ChunkRouter(cache, Pins(cache))
    async with trio.open_nursery() as n:
        await n.start(cache.run)
        # (a write that needs room held by dirty data waits this long for write-back)
        yield db, router, LocalFiles(db, tmp_path, cache, router, wait_budget=2.0)
        n.cancel_scope.cancel()
    cache.flush_atimes()


async def test_reads_are_exact_and_concurrent_reads_share_one_fetch(tmp_path):  # type: ignore
    store = MemoryStore()
    data = os.urandom(2 * CS + 100)
    etag = store.put("k", data)
    store.delay = 0.05
    async with running(tmp_path, store) as (_, chunks, _):
        results: list[bytes] = []

        async def reader() -> None:
            results.append(bytes(await chunks.read("k", etag, len(data), CS - 10, 20)))
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(reader)
        assert results == [data[CS - 10:CS + 10]] * 8
        assert store.calls["get"] == 2 * PIECES  # chunks 0 and 1, once each
        assert bytes(await chunks.read("k", etag, len(data), 0, len(data))) == data
        assert store.calls["get"] == 2 * PIECES + 1


async def test_a_reader_is_answered_before_its_chunk_is_complete(tmp_path):  # type: ignore
    """Stream-through: the first bytes of a chunk are served once their piece is in,
    while the rest of the chunk is still on its way."""
    store = MemoryStore()
    data = os.urandom(CS)
    etag = store.put("k", data)
    gate = trio.Event()
    real = store.get_into

    async def slow_tail(key, etag, start, buf, progress=None):  # type: ignore
        if start >= PIECE:
            await gate.wait()  # the chunk's last piece is held back
        await real(key, etag, start, buf, progress)

    store.get_into = slow_tail  # type: ignore[method-assign]
    async with running(tmp_path, store) as (_, chunks, _):
        with trio.fail_after(5):
            first = bytes(await chunks.read("k", etag, CS, 0, 4096))
        assert first == data[:4096]
        assert chunks.cache.cached("k", etag, 0) is None  # not a cache hit yet
        # (status counts it as landing, not as a chunk: a count taken right after a read
        # is not short by the chunks still on their way)
        assert (chunks.cache.chunk_count(), chunks.cache.chunks_landing()) == (0, 1)
        gate.set()
        assert bytes(await chunks.read("k", etag, CS, PIECE, 100)) == data[PIECE:PIECE + 100]
        with trio.fail_after(5):
            while chunks.cache.cached("k", etag, 0) is None:
                await trio.sleep(0.01)
        assert (chunks.cache.chunk_count(), chunks.cache.chunks_landing()) == (1, 0)


async def test_a_sequential_reader_has_the_readahead_window_in_flight(tmp_path):  # type: ignore
    """The first read of a sequential reader starts the next chunks in the background:
    they arrive in the cache without anyone reading them."""
    store = MemoryStore()
    data = os.urandom(4 * CS)
    etag = store.put("k", data)
    store.delay = 0.05
    async with running(tmp_path, store) as (_, chunks, _):
        src = ObjectSource(chunks, ObjectRef("k", etag, len(data)), readahead_chunks=3)
        assert bytes(await src.read(0, 4096)) == data[:4096]
        with trio.fail_after(5):
            while any(chunks.cache.cached("k", etag, i) is None for i in range(4)):
                await trio.sleep(0.01)
        assert store.calls["get"] == 4 * PIECES
        assert bytes(await src.read(3 * CS, CS)) == data[3 * CS:]
        assert store.calls["get"] == 4 * PIECES


async def test_a_corrupt_cache_file_is_fetched_again(tmp_path):  # type: ignore
    store = MemoryStore()
    data = os.urandom(CS)
    etag = store.put("k", data)
    async with running(tmp_path, store) as (db, chunks, _):
        await chunks.cache.ensure("k", etag, CS, 0)
        ch = chunks.cache.cached("k", etag, 0)
        assert ch is not None
    fd = os.open(ch.path, os.O_RDWR)  # one flipped byte in the middle of the chunk
    try:
        b = os.pread(fd, 1, ch.offset + CS // 2)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), ch.offset + CS // 2)
    finally:
        os.close(fd)
    db.close()
    gets = store.calls["get"]
    async with running(tmp_path, store) as (_, chunks2, _):
        assert bytes(await chunks2.read("k", etag, CS, 0, CS)) == data
        assert chunks2.cache.stats.corrupt == 1
        assert store.calls["get"] > gets  # fetched again, never served


async def test_lru_eviction_keeps_under_capacity_and_index_survives(tmp_path):  # type: ignore
    store = MemoryStore()
    etags = {f"o{i}": store.put(f"o{i}", os.urandom(CS)) for i in range(4)}
    async with running(tmp_path, store, capacity=2 * CS) as (db, chunks, _):
        for k, e in etags.items():
            await chunks.cache.ensure(k, e, CS, 0)
            assert chunks.cache.used <= 2 * CS
        assert not chunks.cache.cached("o0", etags["o0"], 0)
        assert chunks.cache.cached("o3", etags["o3"], 0)
        await chunks.read("o2", etags["o2"], CS, 0, 1)  # o2 becomes most recent
    db.close()
    async with running(tmp_path, store, capacity=2 * CS) as (_, chunks2, _):
        assert chunks2.cache.chunk_count() == 2
        gets = store.calls["get"]
        await chunks2.read("o2", etags["o2"], CS, 0, CS)
        assert store.calls["get"] == gets


async def test_without_room_reads_still_work_and_nothing_is_kept(tmp_path):  # type: ignore
    store = MemoryStore()
    data = os.urandom(CS)
    etag = store.put("k", data)
    async with running(tmp_path, store, capacity=2 * CS) as (_, chunks, local):
        lf = local.create("dirty", Attrs(0o100644, 0, 0, 0))
        await local.write(lf, 0, bytes(2 * CS - 10))  # dirty: never evicted
        assert bytes(await chunks.read("k", etag, CS, 0, CS)) == data
        assert chunks.cache.cached("k", etag, 0) is None
        assert chunks.cache.stats.bypass >= 1


async def test_changed_etag_never_hits_old_chunks(tmp_path):  # type: ignore
    store = MemoryStore()
    e1 = store.put("k", b"one" * 10)
    async with running(tmp_path, store) as (_, chunks, _):
        assert bytes(await chunks.read("k", e1, 30, 0, 3)) == b"one"
        e2 = store.put("k", b"two" * 10)
        assert bytes(await chunks.read("k", e2, 30, 0, 3)) == b"two"


async def test_local_file_overlay_materializes_only_touched_chunks(tmp_path):  # type: ignore
    store = MemoryStore()
    base = bytearray(os.urandom(3 * CS))
    etag = store.put("f", bytes(base))
    async with running(tmp_path, store) as (_, _, local):
        lf = local.create("f", Attrs(0o100644, 0, 0, 0), base=("f", etag, len(base)), etag=etag)
        await local.write(lf, CS + 5, b"XYZ")
        base[CS + 5:CS + 8] = b"XYZ"
        assert lf.materialized == {1}
        assert await local.read(lf, 0, len(base)) == bytes(base)
        await local.truncate(lf, CS + 100)
        await local.truncate(lf, 2 * CS)
        expect = bytes(base[:CS + 100]) + bytes(CS - 100)
        assert await local.read(lf, 0, 2 * CS) == expect
        await local.materialize_all(local.by_key["f"])
        assert await local.read(lf, 0, 2 * CS) == expect


async def test_journal_recovers_dirty_files(tmp_path):  # type: ignore
    store = MemoryStore()
    async with running(tmp_path, store) as (db, _, local):
        lf = local.create("a/b", Attrs(0o100600, 7, 8, 123))
        await local.write(lf, 0, b"payload")
        local.save(lf)
        local.close()
    db.close()
    async with running(tmp_path, store) as (_, _, local2):
        lf2 = local2.by_key["a/b"]
        assert lf2.dirty and lf2.size == 7 and (lf2.mode, lf2.uid, lf2.gid) == (0o100600, 7, 8)
        assert await local2.read(lf2, 0, 100) == b"payload"


async def test_dirty_data_is_never_evicted(tmp_path):  # type: ignore
    store = MemoryStore()
    async with running(tmp_path, store, capacity=2 * CS) as (_, _, local):
        lf = local.create("big", Attrs(0o100644, 0, 0, 0))
        await local.write(lf, 0, bytes(CS + CS // 2))
        other = local.create("other", Attrs(0o100644, 0, 0, 0))
        with pytest.raises(NoSpace):
            await local.write(other, 0, bytes(CS))
        assert lf.size == CS + CS // 2 and not lf.removed
        local.mark_clean(lf, '"etag"')  # once uploaded it may go
        await local.write(other, 0, bytes(CS))
        assert lf.removed


def test_release_free_heap_gives_back_what_big_transient_bytes_left() -> None:
    """Chunk-sized bytes freed between live objects stay resident until the allocator is
    told to give them back (ChunkCache.run does so whenever no download is in flight)."""
    code = """
import sys
from objcache.cache.chunks import release_free_heap

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon:"))

first = bytes(4 << 20)  # freed: glibc raises its mmap threshold above 4 MiB
del first
chunks = [bytearray(4 << 20) for _ in range(40)]  # 160 MiB in the heap
del chunks[::2]  # 80 MiB freed between live chunks: nothing at the heap's top to cut
before = anon()
release_free_heap()
print(before, anon())
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before - after >= 60, (before, after)


def test_digests_of_is_exact_across_pieces(tmp_path: Path) -> None:
    import xxhash

    from objcache.cache.localfiles import FILL_PIECE, digests_of
    data = os.urandom(2 * FILL_PIECE + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [(0, len(data)), (5, FILL_PIECE + 7), (len(data) - 3, len(data)), (9, 9)]
    assert digests_of(str(path), ranges) == [xxhash.xxh3_128_digest(data[a:b])
                                             for a, b in ranges]


def test_digests_of_in_worker_threads_leaves_no_memory_behind(tmp_path: Path) -> None:
    """Every closed file's digest is taken in a worker thread: a FILL_PIECE bytearray
    there grew that thread's malloc arena by 8 MiB for good (malloc_trim does not shrink
    thread arenas), 24-70 MB per daemon that wrote files."""
    small = tmp_path / "small"
    small.write_bytes(os.urandom(1024))
    big = tmp_path / "big"
    big.write_bytes(os.urandom(20 << 20))
    code = f"""
import threading
from objcache.cache.localfiles import digests_of

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon:"))

first = bytes(8 << 20)  # freed: glibc raises its mmap threshold, as in a daemon
del first
before = anon()
go = threading.Barrier(4)

def work(path):
    go.wait()  # at once: each thread takes an arena of its own
    digests_of(path, [(0, 1 << 30)])

ts = [threading.Thread(target=work, args=(p,)) for p in
      [{str(small)!r}] * 3 + [{str(big)!r}]]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(before, anon())
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after - before < 6, (before, after)


async def test_a_truncate_waiting_on_a_blobs_detach_detaches_the_next_linked_blob(
        tmp_path):  # type: ignore
    """`unshare` waits for the linked blob's detach; a close that seals the working copy
    again meanwhile (the RELEASE of the kernel's last writer) links another blob to it.
    That one must get its own file too before the truncate: it was dropped, and the
    truncate shortened the new blob's file under it (a peer then pulled 4 of its 10 bytes
    and routed around a healthy node; test_truncate_and_ftruncate_update_times[cluster])."""
    async with running(tmp_path, MemoryStore()) as (_, _, local):
        lf = local.create("f", Attrs(0o100644, 0, 0, 0))
        await local.write(lf, 0, b"0123456789")
        detached: list[str] = []

        async def detach_second() -> None:
            detached.append("second")

        async def detach_first() -> None:
            await trio.sleep(0.05)  # (a copy made in a thread)
            lf.linked = detach_second  # sealed again while we waited
            detached.append("first")

        lf.linked = detach_first
        await local.truncate(lf, 4)
        assert detached == ["first", "second"]
        assert lf.linked is None


def test_a_digest_reads_through_a_small_buffer(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call's buffer is new memory the kernel faults in and zeroes page by page: one
    of FILL_PIECE per staged piece or uploaded part cost 0.35-0.55 s more CPU per GiB
    than a buffer of DIGEST_PIECE (docs/benchmarks.md, issue 26's run of 2026-11-27)."""
    import mmap

    import xxhash

    from objcache.cache import localfiles
    sizes: list[int] = []
    real = mmap.mmap

    def recording(fileno: int, length: int) -> mmap.mmap:
        sizes.append(length)
        return real(fileno, length)

    monkeypatch.setattr(localfiles.mmap, "mmap", recording)
    data = os.urandom(3 * localfiles.FILL_PIECE)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert localfiles.digests_of(str(path), [(0, len(data))]) == [
        xxhash.xxh3_128_digest(data)]
    assert localfiles.digests_of(str(path), [(0, 100)]) == [xxhash.xxh3_128_digest(data[:100])]
    assert sizes == [localfiles.DIGEST_PIECE, 100]


class _Peer:
    """Another node's chunks (kept in memory only here), counting what it is asked for."""

    from_peer = True

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.fills: list[int] = []

    async def fill(self, cid, obj_size, start, view, progress):  # type: ignore[no-untyped-def]
        self.fills.append(cid[2])
        base = cid[2] * CS + start
        view[:] = self.data[base:base + len(view)]
        progress(len(view))


async def test_a_reader_takes_the_buffer_of_a_chunk_on_disk_before_one_half_read(
        tmp_path):  # type: ignore[no-untyped-def]
    """A reader that needs a download buffer takes one whose chunk is no longer needed
    from memory (read to its end, or on the cache disk) before the oldest: that one may be
    another node's chunk a reader is in the middle of, fetched again over the network for
    its next read (a late joiner fetched 102 MiB of a 96 MiB file from its peers, CI)."""
    store = MemoryStore()
    data = os.urandom(4 * CS)
    etag = store.put("k", data)
    peer = _Peer(data)
    db = StateDB(tmp_path / "state.db")
    cache = ChunkCache(db, tmp_path, 100 << 20, CS, store, buffers=2)  # type: ignore[arg-type]
    async with trio.open_nursery() as n:
        await n.start(cache.run)
        # Chunk 0 is another node's, read half; chunk 1 is ours (kept on disk) and read
        # from memory after it; then a reader needs chunk 2: no buffer is free.
        got = await cache.read("k", etag, len(data), 0, 0, CS // 2, source=peer, keep=False)
        assert bytes(got) == data[:CS // 2]
        assert bytes(await cache.read("k", etag, len(data), 1, 0, 10)) == data[CS:CS + 10]
        with trio.fail_after(5):
            while cache.cached("k", etag, 1) is None:
                await trio.sleep(0.01)
        assert bytes(await cache.read("k", etag, len(data), 2, 0, 10)) == \
            data[2 * CS:2 * CS + 10]
        # The rest of chunk 0 still comes from memory: the peer was asked for it once
        # (one request a piece).
        got = await cache.read("k", etag, len(data), 0, CS // 2, CS // 2, source=peer,
                               keep=False)
        assert bytes(got) == data[CS // 2:CS]
        assert peer.fills.count(0) == PIECES, peer.fills
        n.cancel_scope.cancel()
    cache.flush_atimes()


async def test_an_eviction_right_after_a_read_drops_the_chunk_still_landing(tmp_path):  # type: ignore
    """`objcache evict` just after a read: the chunk the read fetched may still be on its
    way to the cache disk; the eviction waits for it and drops it too (before, it landed
    after the eviction, and the next open was passed through to it: CI)."""
    store = MemoryStore()
    data = os.urandom(CS)
    etag = store.put("k", data)
    async with running(tmp_path, store) as (_, chunks, _):
        cache = chunks.cache
        gate = trio.Event()
        real = cache._keep

        async def slow_keep(fetch):  # type: ignore[no-untyped-def]
            await gate.wait()  # the write to the cache disk is held back
            return await real(fetch)

        cache._keep = slow_keep  # type: ignore[method-assign]
        assert bytes(await chunks.read("k", etag, CS, 0, CS)) == data
        assert (cache.chunk_count(), cache.chunks_landing()) == (0, 1)
        async with trio.open_nursery() as n:
            n.start_soon(_later, gate)
            with trio.fail_after(5):
                dropped, kept = await Pins(cache).evict("k")
        assert (dropped, kept) == (CS, 0)
        assert (cache.chunk_count(), cache.chunks_landing()) == (0, 0)
        assert cache.cached("k", etag, 0) is None


async def _later(ev: trio.Event) -> None:
    await trio.sleep(0.2)
    ev.set()
