"""The chunk cache: fixed-size chunks of clean S3 object versions on the cache disk.

A chunk is named by (key, ETag, index), so a changed object can never be served from the
old version's chunks. Concurrent reads of one chunk share one ranged GET; sequential
readers get readahead; total bytes (chunks plus the local write-back files, which are
charged here too) stay under the capacity by evicting the least recently used clean data.
The index lives in the state database and survives restarts.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from objcache.cache.statedb import StateDB

if TYPE_CHECKING:
    from objcache.store import ObjectStore

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # (key, etag, index)


def _pread(path: str, n: int, offset: int) -> bytes:
    """Read from a chunk file on the trio thread. Deliberate: a cache hit is usually in the
    page cache (microseconds), cheaper than a thread hop (~50-100 us per FUSE request)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


class Chunk:
    __slots__ = ("id", "key", "etag", "idx", "size", "atime", "path")

    def __init__(self, id_: int, key: str, etag: str, idx: int, size: int, atime: float,
                 path: str) -> None:
        self.id = id_
        self.key = key
        self.etag = etag
        self.idx = idx
        self.size = size
        self.atime = atime
        self.path = path


class _Fetch:
    """One in-flight download that concurrent readers of the same chunk wait on."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Chunk | None = None
        self.error: Exception | None = None


class CacheStats:
    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.bypass = 0
        self.evictions = 0
        self.bytes_from_cache = 0
        self.bytes_from_s3 = 0


class ChunkCache:
    """Attributes:
    capacity: byte budget for chunks plus local files.
    chunk_bytes: bytes held by cached chunks (and downloads in flight).
    local_bytes: bytes charged by the write-back store.
    evict_local: hook that drops one clean, unused local file and returns the bytes freed.
    """

    def __init__(self, db: StateDB, root: Path, capacity: int, chunk_size: int,
                 store: ObjectStore) -> None:
        self.db = db
        self.root = root
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.store = store
        self.stats = CacheStats()
        self.chunk_bytes = 0
        self.local_bytes = 0
        self.evict_local: Callable[[], int] = lambda: 0
        self._lru: OrderedDict[ChunkId, Chunk] = OrderedDict()
        self._by_key: dict[str, set[ChunkId]] = {}
        self._fetching: dict[ChunkId, _Fetch] = {}
        self._touched: set[int] = set()
        self._nursery: trio.Nursery | None = None
        (root / "chunks").mkdir(parents=True, exist_ok=True)
        tmp = root / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # half-downloaded chunks from a crash
        tmp.mkdir()
        self._tmp_seq = 0
        self._load()

    # -- index ----------------------------------------------------------------------------

    def _path(self, id_: int) -> str:
        return str(self.root / "chunks" / f"{id_ % 256:02x}" / str(id_))

    def _load(self) -> None:
        known: set[str] = set()
        stale: list[tuple[object, ...]] = []
        for id_, key, etag, idx, size, atime in self.db.execute(
                "SELECT id, key, etag, idx, size, atime FROM chunks ORDER BY atime"):
            path = self._path(id_)
            try:
                ok = os.stat(path).st_size == size
            except FileNotFoundError:
                ok = False
            if not ok:
                stale.append((id_,))
                continue
            known.add(path)
            self._insert(Chunk(id_, key, etag, idx, size, atime, path))
        if stale:
            log.info("dropping %d cache index entries whose chunk files are gone", len(stale))
            self.db.executemany("DELETE FROM chunks WHERE id=?", stale)
        for sub in (self.root / "chunks").iterdir():
            for f in sub.iterdir():
                if str(f) not in known:
                    f.unlink()  # written but never indexed (crash between write and commit)
        log.info("chunk cache: %d chunks, %d bytes", len(self._lru), self.chunk_bytes)

    def _insert(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        self._lru[cid] = ch
        self._by_key.setdefault(ch.key, set()).add(cid)
        self.chunk_bytes += ch.size

    def _remove(self, ch: Chunk) -> None:
        self._remove_index_only(ch)
        self.db.execute("DELETE FROM chunks WHERE id=?", (ch.id,))
        try:
            os.unlink(ch.path)
        except FileNotFoundError:
            pass

    def flush_atimes(self) -> None:
        """Persist access times so the LRU order survives a restart."""
        if not self._touched:
            return
        rows = [(ch.atime, ch.id) for ch in self._lru.values() if ch.id in self._touched]
        self._touched.clear()
        self.db.executemany("UPDATE chunks SET atime=? WHERE id=?", rows)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the readahead nursery and the periodic atime writer."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    await trio.sleep(5)
                    self.flush_atimes()
            finally:
                self.flush_atimes()
                nursery.cancel_scope.cancel()

    # -- space ----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self.chunk_bytes + self.local_bytes

    def make_room(self, nbytes: int) -> bool:
        """Evict clean data (LRU first) until `nbytes` more fit. False if they cannot."""
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            if self._lru:
                self._remove(next(iter(self._lru.values())))
                self.stats.evictions += 1
                continue
            freed = self.evict_local()
            if not freed:
                return False
            self.stats.evictions += 1
        return True

    # -- lookups --------------------------------------------------------------------------

    def chunk_len(self, obj_size: int, idx: int) -> int:
        return max(0, min(self.chunk_size, obj_size - idx * self.chunk_size))

    def is_cached(self, key: str, etag: str, idx: int) -> bool:
        return (key, etag, idx) in self._lru

    async def ensure(self, key: str, etag: str, obj_size: int, idx: int) -> Chunk | None:
        """The cached chunk, downloading it if needed; None if the cache has no room."""
        cid = (key, etag, idx)
        while True:
            ch = self._lru.get(cid)
            if ch is not None:
                self._lru.move_to_end(cid)
                ch.atime = time.time()
                self._touched.add(ch.id)
                return ch
            fetch = self._fetching.get(cid)
            if fetch is None:
                return await self._download(cid, obj_size)
            await fetch.done.wait()
            if fetch.error is not None:
                raise fetch.error
            if fetch.result is None and cid not in self._lru:
                return None
            # else: loop and pick it up from the LRU (also covers a cancelled fetcher)

    async def _download(self, cid: ChunkId, obj_size: int) -> Chunk | None:
        key, etag, idx = cid
        size = self.chunk_len(obj_size, idx)
        fetch = _Fetch()
        self._fetching[cid] = fetch
        try:
            if not self.make_room(size):
                self.stats.bypass += 1
                return None
            self.chunk_bytes += size  # reserved while downloading
            try:
                self._tmp_seq += 1
                tmp = str(self.root / "tmp" / f"{self._tmp_seq}")
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    await self.store.get_range_into(key, etag, idx * self.chunk_size, size,
                                                    fd, 0)
                finally:
                    os.close(fd)
            finally:
                self.chunk_bytes -= size
            self.stats.bytes_from_s3 += size
            now = time.time()
            cur = self.db.execute(
                "INSERT OR REPLACE INTO chunks (key, etag, idx, size, atime) "
                "VALUES (?, ?, ?, ?, ?)", (key, etag, idx, size, now))
            id_ = int(cur.lastrowid or 0)
            path = self._path(id_)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.rename(tmp, path)
            ch = Chunk(id_, key, etag, idx, size, now, path)
            self._insert(ch)
            fetch.result = ch
            return ch
        except Exception as e:
            fetch.error = e
            raise
        finally:
            del self._fetching[cid]
            fetch.done.set()

    async def read(self, key: str, etag: str, obj_size: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of an object version, through the cache."""
        end = min(offset + length, obj_size)
        parts: list[bytes] = []
        cs = self.chunk_size
        while offset < end:
            idx = offset // cs
            n = min(end, (idx + 1) * cs) - offset
            if (key, etag, idx) in self._lru:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            ch = await self.ensure(key, etag, obj_size, idx)
            if ch is None:
                data = await self.store.get_range(key, etag, offset, n)
                self.stats.bytes_from_s3 += len(data)
            else:
                data = _pread(ch.path, n, offset - idx * cs)
                self.stats.bytes_from_cache += len(data)
            parts.append(data)
            offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def prefetch(self, key: str, etag: str, obj_size: int, first: int, count: int) -> None:
        """Start background downloads of chunks first..first+count-1 (readahead)."""
        if self._nursery is None:
            return
        last = (obj_size - 1) // self.chunk_size
        for idx in range(first, min(first + count, last + 1)):
            cid = (key, etag, idx)
            if cid in self._lru or cid in self._fetching:
                continue
            self._nursery.start_soon(self._prefetch_one, key, etag, obj_size, idx)

    async def _prefetch_one(self, key: str, etag: str, obj_size: int, idx: int) -> None:
        try:
            await self.ensure(key, etag, obj_size, idx)
        except Exception as e:  # readahead is best effort; the real read reports errors
            log.debug("readahead of %r chunk %d failed: %s", key, idx, e)

    # -- object-level changes -------------------------------------------------------------

    def drop_object(self, key: str, keep_etag: str | None = None) -> None:
        """Forget cached chunks of `key` (all versions but `keep_etag`)."""
        for cid in list(self._by_key.get(key, ())):
            if cid[1] != keep_etag:
                self._remove(self._lru[cid])

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str) -> None:
        """After a server-side copy the bytes are the same: keep them under the new name."""
        for cid in list(self._by_key.get(old_key, ())):
            if cid[1] != old_etag:
                continue
            ch = self._lru[cid]
            new_cid = (new_key, new_etag, ch.idx)
            if new_cid in self._lru:
                self._remove(ch)
                continue
            self._remove_index_only(ch)
            ch.key, ch.etag = new_key, new_etag
            self.db.execute("UPDATE chunks SET key=?, etag=? WHERE id=?",
                            (new_key, new_etag, ch.id))
            self._insert(ch)

    def _remove_index_only(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        del self._lru[cid]
        ids = self._by_key[ch.key]
        ids.discard(cid)
        if not ids:
            del self._by_key[ch.key]
        self.chunk_bytes -= ch.size

    def chunk_count(self) -> int:
        return len(self._lru)
