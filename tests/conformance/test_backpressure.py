"""Backpressure: a write that needs cache space held by dirty data waits for write-back
to free it instead of failing, on both backends; it fails with ENOSPC only when uploads
free nothing for the whole budget (S3 refusing them) or the data could never fit, and
nothing acknowledged is lost either way."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from objcache.daemon import Parts
from objcache.entries import FlushScope
from objcache.errors import ObjcacheError
from tests.helpers.inproc import FaultyStore, MiB, Posix, cluster, config, node
from tests.helpers.memstore import MemoryStore

UPLOAD_TIME = 0.5
SMALL = {"cache_size": 12 * MiB, "writeback_delay": 3600.0, "s3_retry_seconds": 1.5}


@asynccontextmanager
async def writer(kind: str, store: FaultyStore, root: Path) -> AsyncIterator[Parts]:
    if kind == "local":
        async with node(config(**SMALL), store, root / "node") as p:
            yield p
    else:
        async with cluster(store, root, 2, **SMALL) as (p0, _):
            yield p0


async def _write_in_pieces(fs: Posix, path: str, data: bytes, piece: int = MiB) -> int:
    """Like a checkpoint writer: open, write piece by piece, close. Bytes acknowledged."""
    fh = await fs.create(path)
    done = 0
    try:
        while done < len(data):
            done += await fs.fs.write(fh, done, data[done:done + piece])
    finally:
        await fs.close(fh)
    return done


@pytest.mark.parametrize("kind", ["local", "replicated"])
async def test_checkpoints_bigger_than_the_cache_wait_for_write_back(
        kind: str, tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    # Each upload takes UPLOAD_TIME: the third checkpoint cannot find its room freed
    # before it needs it, whenever write-back starts, so it must wait (a fast upload
    # could free it first, and then nothing here would be shown).
    store.stall("put", UPLOAD_TIME, times=10**6)
    files = {f"ckpt{i}.pt": os.urandom(5 * MiB) for i in range(3)}  # 15 MiB, cache 12
    async with writer(kind, store, tmp_path) as p:
        fs = Posix(p.fs)
        with trio.fail_after(60):
            for name, data in files.items():
                assert await _write_in_pieces(fs, name, data) == len(data)
        assert p.cache.stats.write_waits >= 1
        assert p.cache.used <= p.cache.capacity
        with trio.fail_after(60):
            await p.fs.flush_scope(FlushScope.everything())
        for name, data in files.items():
            assert store.inner.objects[name][0] == data
            assert await fs.read(name) == data


@pytest.mark.parametrize("kind", ["local", "replicated"])
async def test_s3_refusing_uploads_longer_than_the_budget_gives_enospc_and_loses_nothing(
        kind: str, tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    first, second = os.urandom(7 * MiB), os.urandom(7 * MiB)
    async with writer(kind, store, tmp_path) as p:
        fs = Posix(p.fs)
        await _write_in_pieces(fs, "first.pt", first)
        store.fail("put", times=10**6)  # S3 takes nothing from now on
        fh = await fs.create("second.pt")
        acked = 0
        with trio.fail_after(30), pytest.raises(ObjcacheError) as e:
            while acked < len(second):
                acked += await p.fs.write(fh, acked, second[acked:acked + MiB])
        assert e.value.errno == errno.ENOSPC
        assert 0 < acked < len(second)
        await fs.close(fh)
        store.clear()  # S3 is back: everything acknowledged gets there
        with trio.fail_after(60):
            await p.fs.flush_scope(FlushScope.everything())
        assert store.inner.objects["first.pt"][0] == first
        assert store.inner.objects["second.pt"][0] == second[:acked]


async def test_a_write_that_can_never_fit_fails_at_once(tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    cfg: dict[str, Any] = dict(SMALL, s3_retry_seconds=3600.0)
    async with node(config(**cfg), store, tmp_path / "node") as p:
        fs = Posix(p.fs)
        fh = await fs.create("huge.bin")
        with trio.fail_after(10), pytest.raises(ObjcacheError) as e:
            for off in range(0, 13 * MiB, MiB):  # more than the whole cache, still open
                await p.fs.write(fh, off, bytes(MiB))
        assert e.value.errno == errno.ENOSPC
        await fs.close(fh)
