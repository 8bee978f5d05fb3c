"""Chunk cache and write-back store logic, on an in-memory object store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.pins import Pins
from objcache.cache.router import ChunkRouter
from objcache.cache.statedb import StateDB
from objcache.errors import NoSpace
from tests.helpers.memstore import MemoryStore

CS = 5 << 20


def make(tmp_path: Path, store: MemoryStore, capacity: int = 100 << 20):  # type: ignore
    """(db, the chunk router over its cache, the local files)."""
    db = StateDB(tmp_path / "state.db")
    cache = ChunkCache(db, tmp_path, capacity, CS, store)  # type: ignore[arg-type]
    router = ChunkRouter(cache, Pins(cache))
    return db, router, LocalFiles(db, tmp_path, cache, router)


async def test_reads_are_exact_and_concurrent_reads_share_one_get(tmp_path):  # type: ignore
    store = MemoryStore()
    data = os.urandom(2 * CS + 100)
    etag = store.put("k", data)
    store.delay = 0.05
    _, chunks, _ = make(tmp_path, store)
    results: list[bytes] = []

    async def reader() -> None:
        results.append(await chunks.read("k", etag, len(data), CS - 10, 20))
    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(reader)
    assert results == [data[CS - 10:CS + 10]] * 8
    assert store.calls["get"] == 2  # chunks 0 and 1, once each
    assert await chunks.read("k", etag, len(data), 0, len(data)) == data
    assert store.calls["get"] == 3


async def test_lru_eviction_keeps_under_capacity_and_index_survives(tmp_path):  # type: ignore
    store = MemoryStore()
    etags = {f"o{i}": store.put(f"o{i}", os.urandom(CS)) for i in range(4)}
    db, chunks, _ = make(tmp_path, store, capacity=2 * CS)
    for k, e in etags.items():
        await chunks.read(k, e, CS, 0, 10)
        assert chunks.cache.used <= 2 * CS
    assert not chunks.cache.cached("o0", etags["o0"], 0)
    assert chunks.cache.cached("o3", etags["o3"], 0)
    await chunks.read("o2", etags["o2"], CS, 0, 1)  # o2 becomes most recent
    chunks.cache.flush_atimes()
    db.close()
    _, chunks2, _ = make(tmp_path, store, capacity=2 * CS)
    assert chunks2.cache.chunk_count() == 2
    gets = store.calls["get"]
    await chunks2.read("o2", etags["o2"], CS, 0, CS)
    assert store.calls["get"] == gets


async def test_changed_etag_never_hits_old_chunks(tmp_path):  # type: ignore
    store = MemoryStore()
    e1 = store.put("k", b"one" * 10)
    _, chunks, _ = make(tmp_path, store)
    assert await chunks.read("k", e1, 30, 0, 3) == b"one"
    e2 = store.put("k", b"two" * 10)
    assert await chunks.read("k", e2, 30, 0, 3) == b"two"


async def test_local_file_overlay_materializes_only_touched_chunks(tmp_path):  # type: ignore
    store = MemoryStore()
    base = bytearray(os.urandom(3 * CS))
    etag = store.put("f", bytes(base))
    _, chunks, local = make(tmp_path, store)
    lf = local.create("f", 0o100644, 0, 0, 0, base=("f", etag, len(base)), etag=etag)
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
    db, _, local = make(tmp_path, store)
    lf = local.create("a/b", 0o100600, 7, 8, 123)
    await local.write(lf, 0, b"payload")
    local.save(lf)
    local.close()
    db.close()
    _, _, local2 = make(tmp_path, store)
    lf2 = local2.by_key["a/b"]
    assert lf2.dirty and lf2.size == 7 and (lf2.mode, lf2.uid, lf2.gid) == (0o100600, 7, 8)
    assert await local2.read(lf2, 0, 100) == b"payload"


async def test_dirty_data_is_never_evicted(tmp_path):  # type: ignore
    store = MemoryStore()
    _, chunks, local = make(tmp_path, store, capacity=2 * CS)
    lf = local.create("big", 0o100644, 0, 0, 0)
    await local.write(lf, 0, bytes(CS + CS // 2))
    other = local.create("other", 0o100644, 0, 0, 0)
    with pytest.raises(NoSpace):
        await local.write(other, 0, bytes(CS))
    assert lf.size == CS + CS // 2 and not lf.removed
    local.mark_clean(lf, '"etag"')  # once uploaded it may go
    await local.write(other, 0, bytes(CS))
    assert lf.removed
