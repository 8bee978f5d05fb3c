"""The chunk cache: fixed-size chunks of clean S3 object versions on this node's disk.

A chunk is named by (key, ETag, index), so a changed object can never be served from the
old version's chunks. Concurrent misses of one chunk share one download (single flight).
Total bytes (chunks plus what the write-back store charges) stay under the capacity by
evicting the least recently used clean data: chunks first, then whatever other clean data
was offered for eviction (clean local files). The index lives in the state database and
survives restarts. Which node should hold a chunk, and reading other nodes' chunks, is
objcache.cache.router's business; pinning is objcache.cache.pins'.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from objcache.cache.statedb import StateDB
from objcache.errors import StaleObject, StoreError

if TYPE_CHECKING:
    from objcache.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # (key, etag, index)
# Objects up to this size are HEADed with a GET of all of them (see ChunkRouter.
# fetches_whole): on S3 a GET of 1 MiB takes about as long as a HEAD, and a stat'ed small
# file is usually read next.
SMALL_OBJECT = 1 << 20
# Bytes of a chunk from somewhere other than S3 (a peer), or None if it had none.
Fetch = Callable[[], Awaitable[bytes | None]]


class PreviousOwners(Protocol):
    """Where else a chunk may be cached (in a cluster: the nodes that owned it before the
    ring changed). Asked before S3 on a miss; never makes anyone fetch from S3."""

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None: ...


class NoPreviousOwners:
    """A single node: nobody else ever held a chunk."""

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None:
        return None


NO_PREVIOUS = NoPreviousOwners()


def pread(path: str, n: int, offset: int) -> bytes:
    """Read from a chunk file on the trio thread. Deliberate: a cache hit is usually in the
    page cache (microseconds), cheaper than a thread hop (~50-100 us per FUSE request)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


class Chunk:
    __slots__ = ("id", "key", "etag", "idx", "size", "atime", "path", "pinned")

    def __init__(self, id_: int, key: str, etag: str, idx: int, size: int, atime: float,
                 path: str, pinned: bool = False) -> None:
        self.pinned = pinned
        self.id = id_
        self.key = key
        self.etag = etag
        self.idx = idx
        self.size = size
        self.atime = atime
        self.path = path

    def read(self, start: int, n: int) -> bytes:
        return pread(self.path, n, start)


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
        self.bytes_from_peers = 0  # read through peers, or chunks copied from a peer
        self.peer_fallbacks = 0  # peer reads that failed and went to S3 instead
        self.bytes_served_to_peers = 0


class ChunkCache:
    """Attributes:
    capacity: byte budget for chunks plus what others charge (`charge`/`release`).
    chunk_bytes: bytes held by cached chunks (and downloads in flight).
    local_bytes: bytes charged by the write-back store and dirty blobs.
    near_capacity: bytes of other nodes' chunks kept here once they are read repeatedly.
    """

    def __init__(self, db: StateDB, root: Path, capacity: int, chunk_size: int,
                 store: ObjectStore, near_capacity: int = 0) -> None:
        self.db = db
        self.root = root
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.store = store
        self.stats = CacheStats()
        self.chunk_bytes = 0
        self.local_bytes = 0
        self.near_capacity = near_capacity
        self.near_bytes = 0
        self._near: OrderedDict[ChunkId, None] = OrderedDict()  # LRU of near-cache chunks
        self._index: dict[ChunkId, Chunk] = {}  # every cached chunk
        self._lru: OrderedDict[ChunkId, Chunk] = OrderedDict()  # the evictable (unpinned)
        # Other clean data that may go for room (clean local files), oldest offer first:
        # each callback frees what it can and returns the bytes (0: not evictable now).
        self._offered: OrderedDict[object, Callable[[], int]] = OrderedDict()
        self.pinned_bytes = 0
        self._by_key: dict[str, set[ChunkId]] = {}
        self._fetching: dict[ChunkId, _Fetch] = {}
        self._touched: set[int] = set()
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
        for id_, key, etag, idx, size, atime, pinned in self.db.execute(
                "SELECT id, key, etag, idx, size, atime, pinned FROM chunks ORDER BY atime"):
            path = self._path(id_)
            try:
                ok = os.stat(path).st_size == size
            except FileNotFoundError:
                ok = False
            if not ok:
                stale.append((id_,))
                continue
            known.add(path)
            self._insert(Chunk(id_, key, etag, idx, size, atime, path, bool(pinned)))
        if stale:
            log.info("dropping %d cache index entries whose chunk files are gone", len(stale))
            self.db.executemany("DELETE FROM chunks WHERE id=?", stale)
        for sub in (self.root / "chunks").iterdir():
            for f in sub.iterdir():
                if str(f) not in known:
                    f.unlink()  # written but never indexed (crash between write and commit)
        log.info("chunk cache: %d chunks, %d bytes (%d pinned)", len(self._index),
                 self.chunk_bytes, self.pinned_bytes)

    def _insert(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        self._index[cid] = ch
        if ch.pinned:
            self.pinned_bytes += ch.size
        else:
            self._lru[cid] = ch
        self._by_key.setdefault(ch.key, set()).add(cid)
        self.chunk_bytes += ch.size

    def remove(self, ch: Chunk) -> None:
        self._remove_index_only(ch)
        self.db.execute("DELETE FROM chunks WHERE id=?", (ch.id,))
        try:
            os.unlink(ch.path)
        except FileNotFoundError:
            pass

    def _remove_index_only(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        del self._index[cid]
        if ch.pinned:
            self.pinned_bytes -= ch.size
        else:
            del self._lru[cid]
        if cid in self._near:
            del self._near[cid]
            self.near_bytes -= ch.size
        ids = self._by_key[ch.key]
        ids.discard(cid)
        if not ids:
            del self._by_key[ch.key]
        self.chunk_bytes -= ch.size

    def set_pinned(self, ch: Chunk, pinned: bool) -> None:
        """Pinned chunks leave the LRU (and the near-cache) until unpinned."""
        if ch.pinned == pinned:
            return
        self._remove_index_only(ch)
        ch.pinned = pinned
        self._insert(ch)
        self.db.execute("UPDATE chunks SET pinned=? WHERE id=?", (int(pinned), ch.id))

    def flush_atimes(self) -> None:
        """Persist access times so the LRU order survives a restart."""
        if not self._touched:
            return
        rows = [(ch.atime, ch.id) for ch in self._index.values() if ch.id in self._touched]
        self._touched.clear()
        self.db.executemany("UPDATE chunks SET atime=? WHERE id=?", rows)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The periodic atime writer."""
        task_status.started()
        try:
            while True:
                await trio.sleep(5)
                self.flush_atimes()
        finally:
            self.flush_atimes()

    # -- space ----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self.chunk_bytes + self.local_bytes

    def offer(self, token: object, free: Callable[[], int]) -> None:
        """Clean data outside the chunk index that may be dropped for room, after every
        unpinned chunk: `free()` drops it if it still can and returns the bytes freed."""
        self._offered[token] = free
        self._offered.move_to_end(token)

    def make_room(self, nbytes: int) -> bool:
        """Evict clean data (LRU first) until `nbytes` more fit. False if they cannot."""
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            if self._lru:
                self.remove(next(iter(self._lru.values())))
                self.stats.evictions += 1
                continue
            if not self._offered:
                return False
            _, free = self._offered.popitem(last=False)
            if free():
                self.stats.evictions += 1
        return True

    def charge(self, nbytes: int) -> bool:
        """Account `nbytes` of data kept outside the chunk index (evicting for room)."""
        if not self.make_room(nbytes):
            return False
        self.local_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.local_bytes -= nbytes

    # -- lookups --------------------------------------------------------------------------

    def chunk_len(self, obj_size: int, idx: int) -> int:
        return max(0, min(self.chunk_size, obj_size - idx * self.chunk_size))

    def cached(self, key: str, etag: str, idx: int) -> Chunk | None:
        return self._index.get((key, etag, idx))

    def busy(self, key: str, etag: str, idx: int) -> bool:
        """Cached or being fetched: nothing to start for it."""
        cid = (key, etag, idx)
        return cid in self._index or cid in self._fetching

    def _touch(self, cid: ChunkId, ch: Chunk) -> None:
        if not ch.pinned:
            self._lru.move_to_end(cid)
        if cid in self._near:
            self._near.move_to_end(cid)
        ch.atime = time.time()
        self._touched.add(ch.id)

    async def ensure(self, key: str, etag: str, obj_size: int, idx: int,
                     previous: PreviousOwners = NO_PREVIOUS) -> Chunk | None:
        """The cached chunk, downloading it if needed (from a previous owner if one still
        has it, else from S3); None if the cache has no room."""
        cid = (key, etag, idx)
        joined_failure = False
        while True:
            ch = self._index.get(cid)
            if ch is not None:
                self._touch(cid, ch)
                return ch
            fetch = self._fetching.get(cid)
            if fetch is None:
                return await self._download(cid, obj_size, previous)
            await fetch.done.wait()
            if fetch.error is not None:
                if joined_failure:
                    raise fetch.error
                # Someone else's download (a readahead) failed: try once ourselves, the
                # failure may be behind us.
                joined_failure = True
                continue
            if fetch.result is None and cid not in self._index:
                return None
            # else: loop and pick it up from the index (also covers a cancelled fetcher)

    async def ensure_near(self, key: str, etag: str, obj_size: int, idx: int,
                          fetch: Fetch) -> None:
        """Keep a copy of another node's chunk in the near-cache, from `fetch` only."""
        cid = (key, etag, idx)
        if cid not in self._index and cid not in self._fetching:
            await self._download(cid, obj_size, NO_PREVIOUS, near=fetch)

    async def _download(self, cid: ChunkId, obj_size: int, previous: PreviousOwners,
                        near: Fetch | None = None) -> Chunk | None:
        key, etag, idx = cid
        size = self.chunk_len(obj_size, idx)
        fetch = _Fetch()
        self._fetching[cid] = fetch
        try:
            if near is not None:
                while self._near and self.near_bytes + size > self.near_capacity:
                    self.remove(self._index[next(iter(self._near))])
                    self.stats.evictions += 1
            if not self.make_room(size):
                self.stats.bypass += 1
                return None
            self.chunk_bytes += size  # reserved while downloading
            try:
                tmp = self._tmp_path()
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    if not await self._fill(fd, cid, obj_size, size, previous, near):
                        os.unlink(tmp)
                        return None
                finally:
                    os.close(fd)
            finally:
                self.chunk_bytes -= size
            ch = self._adopt(tmp, cid, size)
            if near is not None:
                self._near[cid] = None
                self.near_bytes += size
            fetch.result = ch
            return ch
        except Exception as e:
            fetch.error = e
            raise
        finally:
            del self._fetching[cid]
            fetch.done.set()

    async def _fill(self, fd: int, cid: ChunkId, obj_size: int, size: int,
                    previous: PreviousOwners, near: Fetch | None) -> bool:
        key, etag, idx = cid
        if near is not None:
            data = await near()
            if data is None:
                return False
        else:
            data = await previous.from_previous(key, etag, obj_size, idx)
        if data is None:
            await self.store.get_range_into(key, etag, idx * self.chunk_size, size, fd, 0)
            got = os.fstat(fd).st_size
            if got != size:  # the store must return all of it or raise: never cache less
                raise StoreError(f"S3 returned {got} of {size} bytes of chunk {idx} of "
                                 f"{key!r}")
            self.stats.bytes_from_s3 += size
            return True
        if len(data) != size:
            raise StaleObject(f"a peer sent {len(data)} bytes for chunk {idx} of {key!r}, "
                              f"expected {size}")
        view = memoryview(data)
        done = 0
        while done < size:
            done += os.pwrite(fd, view[done:], done)
        self.stats.bytes_from_peers += size
        return True

    def _adopt(self, tmp: str, cid: ChunkId, size: int) -> Chunk:
        """Make a downloaded temporary file the cached chunk `cid`."""
        key, etag, idx = cid
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
        return ch

    def _tmp_path(self) -> str:
        self._tmp_seq += 1
        return str(self.root / "tmp" / f"{self._tmp_seq}")

    async def head_by_get(self, store: ObjectStore, key: str, listed_size: int
                          ) -> ObjectInfo | None:
        """HEAD a small object with a GET of all of it, keeping the bytes as its chunk 0:
        its first read then costs nothing. A plain HEAD when the cache has no room. None if
        the object is gone. `store` is the caller's view of the bucket (in a cluster it
        hides what the namespace deleted)."""
        if not self.make_room(listed_size):
            return await store.head(key)
        self.chunk_bytes += listed_size  # reserved while downloading
        tmp = self._tmp_path()
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                got = await store.head_by_get(key, listed_size, fd)
            finally:
                os.close(fd)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            self.chunk_bytes -= listed_size
        if got is None:
            os.unlink(tmp)
            return None
        info, n = got
        cid = (key, info.etag, 0)
        # Only a whole object is a complete chunk 0 (it may have grown since the LIST).
        if n == info.size and cid not in self._index and cid not in self._fetching:
            self.stats.bytes_from_s3 += n
            self._adopt(tmp, cid, n)
        else:
            os.unlink(tmp)
        return info

    async def read_local(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                         n: int, previous: PreviousOwners = NO_PREVIOUS) -> bytes:
        """Bytes of one chunk held (or fetched) here; straight from S3 when there is no
        room to cache it."""
        ch = await self.ensure(key, etag, obj_size, idx, previous)
        if ch is None:
            data = await self.store.get_range(key, etag, idx * self.chunk_size + start, n)
            if len(data) != n:
                raise StoreError(f"S3 returned {len(data)} of {n} bytes of {key!r}")
            self.stats.bytes_from_s3 += len(data)
            return data
        data = ch.read(start, n)
        self.stats.bytes_from_cache += len(data)
        return data

    # -- by path ---------------------------------------------------------------------------

    def under(self, prefix: str) -> Iterator[Chunk]:
        """Chunks of `prefix` itself or anything under it ('' = everything)."""
        keys = [k for k in self._by_key if not prefix or k == prefix
                or k.startswith(prefix + "/")]
        return (self._index[cid] for k in keys for cid in list(self._by_key.get(k, ())))

    def drop_object(self, key: str, keep_etag: str | None = None) -> None:
        """Forget cached chunks of `key` (all versions but `keep_etag`)."""
        for cid in list(self._by_key.get(key, ())):
            if cid[1] != keep_etag:
                self.remove(self._index[cid])

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str) -> None:
        """After a server-side copy the bytes are the same: keep them under the new name."""
        for cid in list(self._by_key.get(old_key, ())):
            if cid[1] != old_etag:
                continue
            ch = self._index[cid]
            if (new_key, new_etag, ch.idx) in self._index:
                self.remove(ch)
                continue
            self._remove_index_only(ch)
            ch.key, ch.etag = new_key, new_etag
            self.db.execute("UPDATE chunks SET key=?, etag=? WHERE id=?",
                            (new_key, new_etag, ch.id))
            self._insert(ch)

    def chunk_count(self) -> int:
        return len(self._index)
