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
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from objcache.cache.statedb import StateDB
from objcache.errors import ObjcacheError, StaleObject

if TYPE_CHECKING:
    from objcache.store import ObjectInfo, ObjectStore


class ChunkPeers(Protocol):
    """Where chunks live in a cluster (implemented by objcache.cluster.node). Methods that
    talk to a peer return None when it could not answer, and the cache falls back to S3."""

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        """The node that owns a chunk, or None when it is this node."""
        ...

    async def read(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                   start: int, length: int) -> bytes | None: ...

    async def fetch(self, owner: str, key: str, etag: str, obj_size: int, idx: int
                    ) -> bytes | None:
        """The whole chunk from `owner` (which fetches it from S3 if it must)."""
        ...

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None:
        """The whole chunk from a node that owned it before the ring changed, if one still
        has it cached; never makes anyone fetch from S3."""
        ...

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        """Ask `owner` to start fetching these chunks (readahead), without waiting."""
        ...

    async def ensure_many_remote(self, owner: str, items: list[ChunkRef], pin: bool
                          ) -> list[str] | None:
        """Have `owner` run `ensure_many_local` on these chunks and wait for its outcomes."""
        ...

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # (key, etag, index)
ChunkRef = tuple[str, str, int, int]  # (key, etag, object size, index): enough to fetch it
# Objects up to this size are HEADed with a GET of all of them (see fetches_whole): on S3 a
# GET of 1 MiB takes about as long as a HEAD, and a stat'ed small file is usually read next.
SMALL_OBJECT = 1 << 20


def _pread(path: str, n: int, offset: int) -> bytes:
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
    capacity: byte budget for chunks plus local files.
    chunk_bytes: bytes held by cached chunks (and downloads in flight).
    local_bytes: bytes charged by the write-back store.
    evict_local: hook that drops one clean, unused local file and returns the bytes freed.
    peers: chunk placement in a cluster; None on a single node (every chunk is ours).
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
        self.evict_local: Callable[[], int] = lambda: 0
        self.peers: ChunkPeers | None = None
        self.near_capacity = near_capacity
        self.near_bytes = 0
        self._near: OrderedDict[ChunkId, None] = OrderedDict()  # LRU of near-cache chunks
        self._remote_reads: OrderedDict[ChunkId, int] = OrderedDict()  # bytes read via peers
        self._index: dict[ChunkId, Chunk] = {}  # every cached chunk
        self._lru: OrderedDict[ChunkId, Chunk] = OrderedDict()  # the evictable (unpinned)
        self.pinned_bytes = 0
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
        rows = [(ch.atime, ch.id) for ch in self._index.values() if ch.id in self._touched]
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
        return (key, etag, idx) in self._index

    async def ensure(self, key: str, etag: str, obj_size: int, idx: int) -> Chunk | None:
        """The cached chunk, downloading it if needed; None if the cache has no room."""
        cid = (key, etag, idx)
        while True:
            ch = self._index.get(cid)
            if ch is not None:
                if not ch.pinned:
                    self._lru.move_to_end(cid)
                if cid in self._near:
                    self._near.move_to_end(cid)
                ch.atime = time.time()
                self._touched.add(ch.id)
                return ch
            fetch = self._fetching.get(cid)
            if fetch is None:
                return await self._download(cid, obj_size)
            await fetch.done.wait()
            if fetch.error is not None:
                raise fetch.error
            if fetch.result is None and cid not in self._index:
                return None
            # else: loop and pick it up from the LRU (also covers a cancelled fetcher)

    async def _download(self, cid: ChunkId, obj_size: int, near_from: str | None = None
                        ) -> Chunk | None:
        """Fetch a chunk into the cache: from a previous owner if one still has it, else
        from S3; or, for the near-cache, from its owner `near_from`."""
        key, etag, idx = cid
        size = self.chunk_len(obj_size, idx)
        fetch = _Fetch()
        self._fetching[cid] = fetch
        try:
            if near_from is not None:
                while self._near and self.near_bytes + size > self.near_capacity:
                    self._remove(self._index[next(iter(self._near))])
                    self.stats.evictions += 1
            if not self.make_room(size):
                self.stats.bypass += 1
                return None
            self.chunk_bytes += size  # reserved while downloading
            try:
                tmp = self._tmp_path()
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    if not await self._fill(fd, cid, obj_size, size, near_from):
                        os.unlink(tmp)
                        return None
                finally:
                    os.close(fd)
            finally:
                self.chunk_bytes -= size
            ch = self._adopt(tmp, cid, size)
            if near_from is not None:
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

    def fetches_whole(self, key: str, listed_size: int, listed_etag: str) -> bool:
        """Whether `head_by_get` should GET this object whole here: it is small, not
        cached yet, and its chunk 0 is this node's to hold."""
        return (0 < listed_size <= min(self.chunk_size, SMALL_OBJECT)
                and (key, listed_etag, 0) not in self._index
                and (self.peers is None or self.peers.owner(key, listed_etag, 0) is None))

    async def head_by_get(self, store: ObjectStore, key: str, listed_size: int
                          ) -> ObjectInfo | None:
        """HEAD a small object (see `fetches_whole`) with a GET of all of it, keeping the
        bytes as its chunk 0: its first read then costs nothing. A plain HEAD when the
        cache has no room. None if the object is gone. `store` is the caller's view of
        the bucket (in a cluster it hides what the namespace deleted)."""
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

    async def _fill(self, fd: int, cid: ChunkId, obj_size: int, size: int,
                    near_from: str | None) -> bool:
        key, etag, idx = cid
        data: bytes | None = None
        if near_from is not None:
            assert self.peers is not None
            data = await self.peers.fetch(near_from, key, etag, obj_size, idx)
            if data is None:
                return False
        elif self.peers is not None:
            data = await self.peers.from_previous(key, etag, obj_size, idx)
        if data is None:
            await self.store.get_range_into(key, etag, idx * self.chunk_size, size, fd, 0)
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

    async def read(self, key: str, etag: str, obj_size: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of an object version, through the cache."""
        end = min(offset + length, obj_size)
        parts: list[bytes] = []
        cs = self.chunk_size
        while offset < end:
            idx = offset // cs
            n = min(end, (idx + 1) * cs) - offset
            if (key, etag, idx) in self._index:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                owner = self.peers.owner(key, etag, idx) if self.peers is not None else None
                if owner is not None:
                    data = await self._read_remote(owner, key, etag, obj_size, idx,
                                                   offset - idx * cs, n)
                    if data is not None:
                        parts.append(data)
                        offset += n
                        continue
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

    async def _read_remote(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                           start: int, length: int) -> bytes | None:
        assert self.peers is not None
        data = await self.peers.read(owner, key, etag, obj_size, idx, start, length)
        if data is None:
            self.stats.peer_fallbacks += 1
            return None
        self.stats.bytes_from_peers += len(data)
        # A remote chunk read more than once over (a second epoch, a re-read the page
        # cache lost) is hot: keep a copy in the near-cache.
        cid = (key, etag, idx)
        seen = self._remote_reads.pop(cid, 0) + len(data)
        if (self.near_capacity and seen > self.chunk_len(obj_size, idx)
                and self._nursery is not None and cid not in self._fetching):
            self._nursery.start_soon(self._near_one, owner, cid, obj_size)
        else:
            self._remote_reads[cid] = seen
            if len(self._remote_reads) > 4096:
                self._remote_reads.popitem(last=False)
        return data

    async def _near_one(self, owner: str, cid: ChunkId, obj_size: int) -> None:
        if cid in self._index or cid in self._fetching:
            return
        try:
            await self._download(cid, obj_size, near_from=owner)
        except Exception as e:  # best effort, like readahead
            log.debug("near-cache copy of %r chunk %d failed: %s", cid[0], cid[2], e)

    async def serve(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                    length: int) -> bytes:
        """Bytes of one chunk for a peer, from this node's cache (fetched from S3 or a
        previous owner if missing: never forwarded to another owner, so no loops)."""
        length = max(0, min(length, self.chunk_len(obj_size, idx) - start))
        ch = await self.ensure(key, etag, obj_size, idx)
        if ch is None:  # no room: pass the bytes through
            data = await self.store.get_range(key, etag, idx * self.chunk_size + start, length)
            self.stats.bytes_from_s3 += len(data)
        else:
            data = _pread(ch.path, length, start)
        self.stats.bytes_served_to_peers += len(data)
        return data

    def cached_chunk(self, key: str, etag: str, idx: int) -> bytes | None:
        """The whole chunk if this node has it, without fetching."""
        ch = self._index.get((key, etag, idx))
        if ch is None:
            return None
        data = _pread(ch.path, ch.size, 0)
        self.stats.bytes_served_to_peers += len(data)
        return data

    def readahead(self, key: str, etag: str, obj_size: int, first: int, count: int) -> None:
        """Start background downloads of chunks first..first+count-1 (readahead). In a
        cluster each owner is asked to fetch its own chunks, all owners at once."""
        last = (obj_size - 1) // self.chunk_size
        remote: dict[str, list[int]] = defaultdict(list)
        local: list[int] = []
        for idx in range(first, min(first + count, last + 1)):
            cid = (key, etag, idx)
            if cid in self._index or cid in self._fetching:
                continue
            owner = self.peers.owner(key, etag, idx) if self.peers is not None else None
            if owner is None:
                local.append(idx)
            else:
                remote[owner].append(idx)
        self.readahead_local(key, etag, obj_size, local)
        if self.peers is not None:
            for owner, idxs in remote.items():
                self.peers.readahead(owner, key, etag, obj_size, idxs)

    def readahead_local(self, key: str, etag: str, obj_size: int, idxs: list[int]) -> None:
        """Start background downloads of these chunks into this node's cache."""
        if self._nursery is None:
            return
        for idx in idxs:
            cid = (key, etag, idx)
            if cid in self._index or cid in self._fetching:
                continue
            self._nursery.start_soon(self._readahead_one, key, etag, obj_size, idx)

    async def _readahead_one(self, key: str, etag: str, obj_size: int, idx: int) -> None:
        try:
            await self.ensure(key, etag, obj_size, idx)
        except Exception as e:  # readahead is best effort; the real read reports errors
            log.debug("readahead of %r chunk %d failed: %s", key, idx, e)

    # -- prefetch, pinning, eviction by path ------------------------------------------------

    def _pin(self, ch: Chunk) -> None:
        if ch.pinned:
            return
        self._remove_index_only(ch)  # (also out of the near-cache: pinned data stays)
        ch.pinned = True
        self._insert(ch)
        self.db.execute("UPDATE chunks SET pinned=1 WHERE id=?", (ch.id,))

    async def ensure_many_local(self, items: list[ChunkRef], pin: bool) -> list[str]:
        """Make these chunks cached here (pinned if asked); one outcome per item:
        "cached" (it already was), "fetched", or an error message."""
        out = [""] * len(items)
        limit = trio.Semaphore(16)

        async def one(i: int, ref: ChunkRef) -> None:
            key, etag, size, idx = ref
            async with limit:
                was = (key, etag, idx) in self._index
                try:
                    ch = await self.ensure(key, etag, size, idx)
                except ObjcacheError as e:
                    out[i] = f"{type(e).__name__}: {e}"
                    return
                if ch is None:
                    out[i] = ("NoSpace: the cache is full of pinned or dirty data"
                              if pin else "NoSpace: no room in the cache")
                    return
                if pin:
                    self._pin(ch)
                out[i] = "cached" if was else "fetched"

        async with trio.open_nursery() as nursery:
            for i, ref in enumerate(items):
                nursery.start_soon(one, i, ref)
        return out

    async def ensure_many(self, items: list[ChunkRef], pin: bool) -> list[str]:
        """`ensure_many_local` across the cluster: each owner fetches (and pins) its own chunks, all
        owners in parallel; chunks of an owner that cannot answer are fetched here."""
        by_owner: dict[str | None, list[int]] = defaultdict(list)
        for i, (key, etag, _, idx) in enumerate(items):
            owner = self.peers.owner(key, etag, idx) if self.peers is not None else None
            by_owner[owner].append(i)
        out = [""] * len(items)

        async def run(owner: str | None, idxs: list[int]) -> None:
            part = [items[i] for i in idxs]
            res = None
            if owner is not None and self.peers is not None:
                res = await self.peers.ensure_many_remote(owner, part, pin)
            if res is None:
                res = await self.ensure_many_local(part, pin)
            for i, r in zip(idxs, res, strict=True):
                out[i] = r

        async with trio.open_nursery() as nursery:
            for owner, idxs in by_owner.items():
                nursery.start_soon(run, owner, idxs)
        return out

    def _matching(self, prefix: str) -> list[Chunk]:
        """Chunks of `prefix` itself or anything under it ('' = everything)."""
        keys = [k for k in self._by_key if not prefix or k == prefix
                or k.startswith(prefix + "/")]
        return [self._index[cid] for k in keys for cid in self._by_key[k]]

    def unpin(self, prefix: str) -> int:
        """Make pinned chunks under `prefix` evictable again; returns their bytes."""
        total = 0
        for ch in self._matching(prefix):
            if ch.pinned:
                self._remove_index_only(ch)
                ch.pinned = False
                self._insert(ch)
                self.db.execute("UPDATE chunks SET pinned=0 WHERE id=?", (ch.id,))
                total += ch.size
        return total

    def evict(self, prefix: str) -> tuple[int, int]:
        """Drop unpinned chunks under `prefix`; returns (bytes dropped, pinned bytes kept)."""
        dropped = kept = 0
        for ch in self._matching(prefix):
            if ch.pinned:
                kept += ch.size
            else:
                self._remove(ch)
                dropped += ch.size
        return dropped, kept

    # -- object-level changes -------------------------------------------------------------

    def drop_object(self, key: str, keep_etag: str | None = None) -> None:
        """Forget cached chunks of `key` (all versions but `keep_etag`)."""
        for cid in list(self._by_key.get(key, ())):
            if cid[1] != keep_etag:
                self._remove(self._index[cid])

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str) -> None:
        """After a server-side copy the bytes are the same: keep them under the new name."""
        for cid in list(self._by_key.get(old_key, ())):
            if cid[1] != old_etag:
                continue
            ch = self._index[cid]
            new_cid = (new_key, new_etag, ch.idx)
            if new_cid in self._index:
                self._remove(ch)
                continue
            self._remove_index_only(ch)
            ch.key, ch.etag = new_key, new_etag
            self.db.execute("UPDATE chunks SET key=?, etag=? WHERE id=?",
                            (new_key, new_etag, ch.id))
            self._insert(ch)

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

    def chunk_count(self) -> int:
        return len(self._index)
