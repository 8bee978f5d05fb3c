"""The chunk cache: fixed-size chunks of clean S3 object versions on this node's disk.

A chunk is named by (key, ETag, index), so a changed object can never be served from the
old version's chunks. A missing chunk is fetched once however many readers want it
(single flight), into a memory buffer, as several ranged GETs in parallel; readers are
answered from the buffer as soon as their bytes have arrived, not when the chunk is
complete. A complete chunk is checksummed and written to the cache disk off the readers'
path (O_DIRECT where the disk takes it: no page-cache copy, a fraction of the CPU), and
only then becomes a cache hit. Every read of a cached chunk verifies the xxh3 sums of the
256 KiB blocks it touches, so a corrupt cache file is fetched again, never served.

On disk, each object version is one sparse file (objects/XX/<id>): chunk i at offset
i * chunk size, holes where a chunk is not cached. Once every chunk of a version is there,
that file is the object's bytes, and the kernel can serve it without us
(objcache.core.passthrough: `whole_file`, `hold`): reads through passthrough are not
checked block by block, so the sums are checked when a chunk is filled (they are taken
from the bytes that arrived) and by `verify` (objcache verify); a chunk that fails is
dropped, and an object missing a chunk is never a backing file. A held file is never
evicted, and a hole is never punched under a passthrough reader.

Total bytes (chunks plus what the write-back store charges) stay under the capacity by
evicting the least recently used clean data: chunks first, then whatever other clean data
was offered for eviction (clean local files). The index lives in the state database and
survives restarts. Which node should hold a chunk, and reading other nodes' chunks, is
objcache.cache.router's business; pinning is objcache.cache.pins'.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio
import xxhash

from objcache.cache.statedb import StateDB
from objcache.config import disk_reserve
from objcache.errors import StaleObject, StoreError, first_error
from objcache.ticks import sleep_ticks

if TYPE_CHECKING:
    from objcache.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # (key, etag, index)
# Objects up to this size are HEADed with a GET of all of them (see ChunkRouter.
# fetches_whole): on S3 a GET of 1 MiB takes about as long as a HEAD, and a stat'ed small
# file is usually read next.
SMALL_OBJECT = 1 << 20
# A chunk is fetched as ranged GETs of this size, in parallel: a reader waits for its own
# piece only, and one chunk keeps several connections busy (S3 and SeaweedFS serve one
# connection at a fraction of what several do).
PIECE = 4 << 20
VERIFY_BLOCK = 256 << 10  # checksummed unit of a cached chunk
OPEN_CHUNKS = 16  # cached chunk files kept open for reading
IDLE_BUFFER = 5.0  # seconds a completed download's buffer is kept when nobody reads it
CROWDED = 0.8  # fraction of the cache above which write-back uploads closed files at once
PAGE = mmap.PAGESIZE


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


class ChunkSource(Protocol):
    """Where a chunk's bytes come from on a miss: S3, or the node that owns the chunk.
    `fill` puts bytes [start, start+len(view)) of the chunk into `view`, calling
    `progress(n)` on the trio thread as they arrive; it raises if it cannot."""

    from_peer: bool

    async def fill(self, cid: ChunkId, obj_size: int, start: int, view: memoryview,
                   progress: Callable[[int], None]) -> None: ...


class _S3Source:
    from_peer = False

    def __init__(self, store: ObjectStore, chunk_size: int) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.token: trio.lowlevel.TrioToken | None = None

    async def fill(self, cid: ChunkId, obj_size: int, start: int, view: memoryview,
                   progress: Callable[[int], None]) -> None:
        key, etag, idx = cid
        token = self.token or trio.lowlevel.current_trio_token()

        def in_thread(n: int) -> None:  # called from the download thread
            token.run_sync_soon(progress, n)

        await self.store.get_into(key, etag, idx * self.chunk_size + start, view, in_thread)


class CorruptChunk(Exception):
    """A cached chunk's bytes do not match their checksums."""


def block_sums(data: memoryview) -> bytes:
    """xxh3-64 of each VERIFY_BLOCK of `data`, concatenated."""
    return b"".join(xxhash.xxh3_64_digest(data[i:i + VERIFY_BLOCK])
                    for i in range(0, len(data), VERIFY_BLOCK))


def _write_files(paths: list[str], bodies: list[bytes]) -> list[bytes]:
    """Write each body to its new file; their block sums. In a worker thread. On a
    failure the files written so far are removed."""
    sums: list[bytes] = []
    try:
        for path, body in zip(paths, bodies, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            sums.append(block_sums(memoryview(body)))
    except BaseException:
        for path in paths[:len(sums) + 1]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        raise
    return sums


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc's; other C libraries: none


def release_free_heap() -> None:
    """Give the C allocator's free pages back to the system (glibc's malloc_trim: a few
    microseconds when there is little to give). Chunk-sized bytes (a range served to a
    peer, a read's reply) come and go all the time; once glibc has freed one it raised
    its mmap threshold, so the next ones are carved from the heap, and the free space they
    leave between live objects stays resident: 45 MB in an in-process cluster after three
    cold reads of 64 MiB, 8 MiB chunks, freed by this."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def punch_hole(path: str, offset: int, length: int) -> None:
    """Give the disk blocks of [offset, offset+length) of `path` back (reads give zeros)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    try:
        if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset,
                           length) != 0:
            e = ctypes.get_errno()
            log.info("could not free %d bytes of %s: %s", length, path, os.strerror(e))
    finally:
        os.close(fd)


def _nothing(path: str) -> None:
    pass


class ObjFile:
    """One object version's file in the cache: its chunks at their offsets.

    chunks: the indexes cached; holds: passthrough opens using it as their backing file
    (its chunks leave the LRU meanwhile); doomed: chunks dropped while it was held, whose
    holes are punched once nobody reads it any more.
    """

    __slots__ = ("id", "key", "etag", "size", "path", "chunks", "holds", "doomed")

    def __init__(self, id_: int, key: str, etag: str, size: int, path: str) -> None:
        self.id = id_
        self.key = key
        self.etag = etag
        self.size = size
        self.path = path
        self.chunks: set[int] = set()
        self.holds = 0
        self.doomed: set[int] = set()


class Chunk:
    __slots__ = ("id", "key", "etag", "idx", "size", "atime", "obj", "offset", "pinned",
                 "sums")

    def __init__(self, id_: int, key: str, etag: str, idx: int, size: int, atime: float,
                 obj: ObjFile, offset: int, sums: bytes, pinned: bool = False) -> None:
        self.pinned = pinned
        self.id = id_
        self.key = key
        self.etag = etag
        self.idx = idx
        self.size = size
        self.atime = atime
        self.obj = obj
        self.offset = offset  # in the object's file
        self.sums = sums

    @property
    def path(self) -> str:
        return self.obj.path


class _Files:
    """Object files kept open for reading, the most recently used few."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._fds: OrderedDict[int, int] = OrderedDict()

    def fd(self, obj: ObjFile) -> int:
        fd = self._fds.get(obj.id)
        if fd is not None:
            self._fds.move_to_end(obj.id)
            return fd
        fd = os.open(obj.path, os.O_RDONLY)
        self._fds[obj.id] = fd
        while len(self._fds) > self.count:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def drop(self, obj: ObjFile) -> None:
        fd = self._fds.pop(obj.id, None)
        if fd is not None:
            os.close(fd)


class BufferPool:
    """Chunk-sized anonymous memory for downloads in flight: bounded (the daemon's memory
    stays flat however much is read), reused, and page-aligned (O_DIRECT writes from it)."""

    def __init__(self, size: int, count: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self.count = count
        self._free: list[mmap.mmap] = []
        self._made = 0
        self._freed = trio.Event()

    def try_take(self, reserve: int = 0) -> mmap.mmap | None:
        """A free buffer, unless only `reserve` are left (kept for readers)."""
        if len(self._free) + self.count - self._made <= reserve:
            return None
        if self._free:
            return self._free.pop()
        self._made += 1
        return mmap.mmap(-1, self.size)

    async def freed(self) -> None:
        """Until a buffer is given back."""
        await self._freed.wait()

    def give(self, buf: mmap.mmap) -> None:
        self._free.append(buf)
        self.nudge()

    def nudge(self) -> None:
        """Wake whoever waits for a buffer (one may be free, or reclaimable, now)."""
        self._freed.set()
        self._freed = trio.Event()

    def trim(self) -> None:
        """Return idle buffers' pages to the system (they are re-faulted on next use)."""
        for buf in self._free:
            buf.madvise(mmap.MADV_DONTNEED)

    @property
    def in_use(self) -> int:
        return self._made - len(self._free)


class _Fetch:
    """A chunk being fetched: readers wait for the bytes they need as they arrive (`got`:
    bytes in from the start of each piece), everyone waits for the end (`done`). The
    buffer goes back to the pool only once no reader is waiting on it (`readers`)."""

    __slots__ = ("cid", "size", "obj_size", "source", "keep", "near", "buf", "view", "pieces",
                 "got",
                 "moved", "done", "result", "error", "readers", "idle", "read_to", "used")

    def __init__(self, cid: ChunkId, size: int, obj_size: int, source: ChunkSource,
                 keep: bool, near: bool = False) -> None:
        self.cid = cid
        self.size = size
        self.obj_size = obj_size
        self.source = source
        self.keep = keep  # becomes a cache file when complete (if there is room)
        self.near = near  # ... in the near-cache's budget
        self.buf: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.pieces = [(s, min(size, s + PIECE)) for s in range(0, max(size, 1), PIECE)]
        self.got = [0] * len(self.pieces)
        self.moved = trio.Event()
        self.done = trio.Event()
        self.result: Chunk | None = None
        self.error: BaseException | None = None
        self.readers = 0
        self.idle = trio.Event()
        self.read_to = 0  # how far readers have read (a buffer read to its end may go)
        self.used = 0.0  # when a reader last read it

    def advance(self, piece: int, got: int) -> None:
        self.got[piece] = max(self.got[piece], got)
        self._moved()

    def fill_all(self) -> None:
        for i, (s, e) in enumerate(self.pieces):
            self.got[i] = e - s
        self._moved()

    def _moved(self) -> None:
        self.moved.set()
        self.moved = trio.Event()

    def has(self, start: int, end: int) -> bool:
        for i, (s, e) in enumerate(self.pieces):
            if s < end and start < e and s + self.got[i] < min(e, end):
                return False
        return True

    async def wait_for(self, start: int, end: int, volatile: bool = False
                       ) -> bytes | memoryview:
        """Bytes [start, end) of the chunk once they have arrived: a copy (the buffer is
        reused later), or a view if the caller uses it before it next awaits."""
        self.readers += 1
        try:
            while True:
                if self.error is not None:
                    raise self.error
                if self.view is not None and self.has(start, end):
                    self.read_to = max(self.read_to, end)
                    self.used = time.monotonic()
                    view = self.view[start:end]
                    return view if volatile else bytes(view)
                if self.view is None and self.done.is_set():
                    raise _Retry  # over before we got here: the index has it, or not
                await self.moved.wait()
        finally:
            self.readers -= 1
            if not self.readers:
                self.idle.set()

    async def drained(self) -> None:
        """Until no reader is between its wake-up and its copy."""
        while self.readers:
            self.idle = trio.Event()
            self._moved()
            await self.idle.wait()


class _Retry(Exception):
    pass


class CacheStats:
    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.bypass = 0
        self.evictions = 0
        self.bytes_from_cache = 0  # served by this node: its cache files or its downloads
        self.bytes_from_s3 = 0  # downloaded from S3 (readahead included)
        self.bytes_from_peers = 0  # read by readers from chunks that came from a peer
        self.bytes_fetched_from_peers = 0  # moved from peers (readahead included)
        self.peer_fallbacks = 0  # peer reads that failed and went to S3 instead
        self.bytes_served_to_peers = 0
        self.corrupt = 0  # cached chunks that failed their checksums (fetched again)
        self.write_waits = 0  # writes that waited for write-back to free cache space
        self.write_wait_seconds = 0.0  # ... and how long, in total


def _write_chunk(path: str, offset: int, data: memoryview, size: int, obj_size: int
                 ) -> None:
    """Write a complete chunk into its object's file at `offset` (in a worker thread):
    O_DIRECT when the file system takes it (from the page-aligned buffer, rounded up to
    whole pages; the file is cut back to the object's size after), else a plain write."""
    aligned = -(-size // PAGE) * PAGE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fd = -1
    if fd >= 0:
        try:
            done = 0
            while done < aligned:
                done += os.pwrite(fd, data[done:aligned], offset + done)
            if offset + aligned > obj_size:
                os.ftruncate(fd, obj_size)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        finally:
            os.close(fd)
    fd = os.open(path, os.O_WRONLY)
    try:
        view = data[:size]
        done = 0
        while done < size:
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


def _check_sums(path: str, offset: int, size: int, sums: bytes) -> bool:
    """Whether a chunk's bytes in its object's file match their sums (a worker thread)."""
    with open(path, "rb", buffering=0) as f:
        for b in range(0, -(-size // VERIFY_BLOCK)):
            n = min(VERIFY_BLOCK, size - b * VERIFY_BLOCK)
            data = os.pread(f.fileno(), n, offset + b * VERIFY_BLOCK)
            if len(data) != n or xxhash.xxh3_64_digest(data) != sums[b * 8:b * 8 + 8]:
                return False
    return True


class ChunkCache:
    """Attributes:
    capacity: byte budget for chunks plus what others charge (`charge`/`release`): the
        configured size, or less when the disk holds less (it is measured, so a disk
        that other data fills makes the cache evict rather than fail writes).
    chunk_bytes: bytes held by cached chunks (and downloads that will be cached).
    local_bytes: bytes charged by the write-back store and dirty blobs.
    near_capacity: bytes of other nodes' chunks kept here once they are read repeatedly.
    """

    def __init__(self, db: StateDB, root: Path, capacity: int, chunk_size: int,
                 store: ObjectStore, near_capacity: int = 0, buffers: int = 6,
                 file_gone: Callable[[str], None] = _nothing) -> None:
        self.db = db
        # Told when an object's file leaves the cache (unlinked or handed over): a
        # passthrough registration of it must not keep its space (core.passthrough).
        self.file_gone = file_gone
        self.root = root
        self.configured = capacity
        self._stat_at = -1e9
        self._disk_free = 0  # what statvfs said, at _stat_at ...
        self._used_at_stat = 0  # ... when `used` was this
        self._reserve = 0
        self.chunk_size = chunk_size
        self.store = store
        self.s3 = _S3Source(store, chunk_size)
        self.stats = CacheStats()
        self.chunk_bytes = 0
        self.local_bytes = 0
        self.near_capacity = near_capacity
        self.near_bytes = 0
        self.buffers = BufferPool(chunk_size, max(2, buffers))
        self.disk = trio.CapacityLimiter(2)  # chunk files written at once
        self._files = _Files(OPEN_CHUNKS)
        self._near: OrderedDict[ChunkId, None] = OrderedDict()  # LRU of near-cache chunks
        self._index: dict[ChunkId, Chunk] = {}  # every cached chunk
        self._lru: OrderedDict[ChunkId, Chunk] = OrderedDict()  # the evictable (unpinned)
        # Other clean data that may go for room (clean local files), oldest offer first:
        # each callback frees what it can and returns the bytes (0: not evictable now).
        self._offered: OrderedDict[object, Callable[[], int]] = OrderedDict()
        self.pinned_bytes = 0
        self._by_key: dict[str, set[ChunkId]] = {}
        self._fetching: dict[ChunkId, _Fetch] = {}
        # Completed downloads whose buffer is kept (the most recent first to go is the
        # oldest): a reader behind the download reads memory, not the cache disk, until
        # the buffer is needed for another download.
        self._recent: OrderedDict[ChunkId, _Fetch] = OrderedDict()
        self._touched: set[int] = set()
        self._room = trio.Event()  # set (and replaced) whenever space may have been freed
        self.waiting_for_room = 0  # writers waiting for write-back to free space
        self._advised: OrderedDict[ChunkId, None] = OrderedDict()
        # Chunks that will be cache hits once the write under way is done (see `landed`).
        self._landing: dict[ChunkId, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._objects: dict[tuple[str, str], ObjFile] = {}  # by (key, etag)
        (root / "objects").mkdir(parents=True, exist_ok=True)
        tmp = root / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # half-written small objects from a crash
        tmp.mkdir()
        self._tmp_seq = 0
        self._load()

    # -- index ----------------------------------------------------------------------------

    def _obj_path(self, id_: int) -> str:
        return str(self.root / "objects" / f"{id_ % 256:02x}" / str(id_))

    def _load(self) -> None:
        objs: dict[int, ObjFile] = {}
        gone: list[tuple[object, ...]] = []
        for id_, key, etag, size in self.db.execute(
                "SELECT id, key, etag, size FROM objects"):
            path = self._obj_path(id_)
            try:
                if os.stat(path).st_size != size:
                    os.truncate(path, size)  # (cut short by a crash after a rounded write)
            except FileNotFoundError:
                gone.append((id_,))
                continue
            objs[id_] = ObjFile(id_, key, etag, size, path)
        stale: list[tuple[object, ...]] = []
        for id_, key, etag, idx, size, atime, pinned, sums, oid in self.db.execute(
                "SELECT id, key, etag, idx, size, atime, pinned, sums, obj FROM chunks "
                "ORDER BY atime"):
            obj = objs.get(oid) if oid is not None else None
            if obj is None or sums is None or idx * self.chunk_size + size > obj.size:
                stale.append((id_,))
                continue
            self._insert(Chunk(id_, key, etag, idx, size, atime, obj, idx * self.chunk_size,
                               bytes(sums), bool(pinned)))
        if stale:
            log.info("dropping %d cache index entries whose files are gone, were never "
                     "checksummed or are of the old layout", len(stale))
            self.db.executemany("DELETE FROM chunks WHERE id=?", stale)
        for obj in objs.values():
            if not obj.chunks:
                gone.append((obj.id,))
                os.unlink(obj.path)
                continue
            self._objects[(obj.key, obj.etag)] = obj
            # Bytes written but never indexed (a crash between the write and the commit)
            # take disk space nobody accounts for: give them back.
            for idx in range(-(-obj.size // self.chunk_size)):
                if idx not in obj.chunks:
                    punch_hole(obj.path, idx * self.chunk_size, self.chunk_size)
        if gone:
            self.db.executemany("DELETE FROM objects WHERE id=?", gone)
        known = {obj.path for obj in self._objects.values()}
        for sub in (self.root / "objects").iterdir():
            for f in sub.iterdir():
                if str(f) not in known:
                    f.unlink()  # created but never indexed
        shutil.rmtree(self.root / "chunks", ignore_errors=True)  # the old layout's files
        log.info("chunk cache: %d chunks of %d objects, %d bytes (%d pinned)",
                 len(self._index), len(self._objects), self.chunk_bytes, self.pinned_bytes)

    def _obj_for(self, key: str, etag: str, size: int) -> ObjFile:
        """The file of object version (key, etag), made (sparse) if it has none yet."""
        obj = self._objects.get((key, etag))
        if obj is not None and obj.size == size:
            return obj
        if obj is not None:  # the same version with another size: never both
            for idx in list(obj.chunks):
                self.remove(self._index[(key, etag, idx)])
        cur = self.db.execute("INSERT OR REPLACE INTO objects (key, etag, size) "
                              "VALUES (?, ?, ?)", (key, etag, size))
        id_ = int(cur.lastrowid or 0)
        path = self._obj_path(id_)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        obj = self._objects[(key, etag)] = ObjFile(id_, key, etag, size, path)
        return obj

    def _forget_obj(self, obj: ObjFile) -> None:
        """The object version has no chunk here any more: its file goes (a passthrough
        reader keeps the file it has open)."""
        if self._objects.get((obj.key, obj.etag)) is obj:
            del self._objects[(obj.key, obj.etag)]
        self._files.drop(obj)
        self.db.execute("DELETE FROM objects WHERE id=?", (obj.id,))
        self.file_gone(obj.path)
        try:
            os.unlink(obj.path)
        except FileNotFoundError:
            pass

    def _insert(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        self._index[cid] = ch
        ch.obj.chunks.add(ch.idx)
        if ch.pinned:
            self.pinned_bytes += ch.size
        elif not ch.obj.holds:
            self._lru[cid] = ch
        self._by_key.setdefault(ch.key, set()).add(cid)
        self.chunk_bytes += ch.size

    def remove(self, ch: Chunk) -> None:
        self._room_freed()
        self._remove_index_only(ch)
        self.db.execute("DELETE FROM chunks WHERE id=?", (ch.id,))
        obj = ch.obj
        if not obj.chunks:
            self._forget_obj(obj)
        elif obj.holds:
            obj.doomed.add(ch.idx)  # never a hole under a passthrough reader
        else:
            punch_hole(obj.path, ch.offset, ch.size)

    def _remove_index_only(self, ch: Chunk) -> None:
        cid = (ch.key, ch.etag, ch.idx)
        del self._index[cid]
        ch.obj.chunks.discard(ch.idx)
        if ch.pinned:
            self.pinned_bytes -= ch.size
        else:
            self._lru.pop(cid, None)
        if cid in self._near:
            del self._near[cid]
            self.near_bytes -= ch.size
        ids = self._by_key[ch.key]
        ids.discard(cid)
        if not ids:
            del self._by_key[ch.key]
        self.chunk_bytes -= ch.size

    def _near_room(self, size: int) -> None:
        """Evict near-cache chunks (oldest first, never one a passthrough open holds)
        until `size` more fit in its budget."""
        while self.near_bytes + size > self.near_capacity:
            victim = next((c for c in self._near if not self._index[c].obj.holds), None)
            if victim is None:
                return
            self.remove(self._index[victim])
            self.stats.evictions += 1

    # -- whole objects (passthrough) --------------------------------------------------------

    def whole_file(self, key: str, etag: str, size: int) -> str | None:
        """The file of object version (key, etag) if every chunk of it is here."""
        obj = self._objects.get((key, etag))
        if (obj is None or obj.size != size or size == 0 or obj.doomed
                or len(obj.chunks) != -(-size // self.chunk_size)):
            return None
        return obj.path

    def hold(self, key: str, etag: str) -> ObjFile:
        """A passthrough open uses the object's file: none of it is evicted meanwhile."""
        obj = self._objects[(key, etag)]
        obj.holds += 1
        if obj.holds == 1:
            for idx in obj.chunks:
                self._lru.pop((obj.key, obj.etag, idx), None)
        return obj

    def holds_file(self, obj: ObjFile) -> bool:
        """Whether `obj` is still the cache's file of its version."""
        return self._objects.get((obj.key, obj.etag)) is obj

    def unhold(self, obj: ObjFile) -> None:
        obj.holds -= 1
        if obj.holds or self._objects.get((obj.key, obj.etag)) is not obj:
            return  # still held, or dropped meanwhile (its file went; the reader had it)
        for idx in sorted(obj.chunks):
            ch = self._index[(obj.key, obj.etag, idx)]
            if not ch.pinned:
                self._lru[(obj.key, obj.etag, idx)] = ch
        for idx in obj.doomed:
            punch_hole(obj.path, idx * self.chunk_size, self.chunk_size)
        obj.doomed.clear()
        self._room_freed()

    def hand_over(self, obj: ObjFile) -> str:
        """The object version's (complete) file leaves the cache: a writer makes it its
        working copy. Its chunks are forgotten; the file is the caller's."""
        del self._objects[(obj.key, obj.etag)]
        for idx in list(obj.chunks):
            ch = self._index[(obj.key, obj.etag, idx)]
            self._remove_index_only(ch)
            self.db.execute("DELETE FROM chunks WHERE id=?", (ch.id,))
        self.db.execute("DELETE FROM objects WHERE id=?", (obj.id,))
        self._files.drop(obj)
        self.file_gone(obj.path)
        self._room_freed()
        return obj.path

    async def verify(self, prefix: str = "") -> tuple[int, int, int]:
        """Read every cached chunk under `prefix` and check it against its sums; drop the
        ones that fail. (chunks checked, bytes checked, corrupt)."""
        checked = nbytes = bad = 0
        for ch in list(self.under(prefix)):
            ok = await trio.to_thread.run_sync(_check_sums, ch.obj.path, ch.offset, ch.size,
                                               ch.sums, limiter=self.disk)
            cid = (ch.key, ch.etag, ch.idx)
            if self._index.get(cid) is not ch:
                continue  # gone meanwhile
            checked += 1
            nbytes += ch.size
            if not ok:
                bad += 1
                self._corrupt(ch, CorruptChunk(f"chunk {ch.idx} of {ch.key!r}"))
        return checked, nbytes, bad

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
        """Own the downloads (they outlive the reader that started them: others may be
        waiting), the periodic atime writer and, while nothing is downloading, the
        trimming of idle buffers and of the allocator's free memory."""
        self.s3.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    await sleep_ticks(5)
                    self.flush_atimes()
                    idle = time.monotonic() - IDLE_BUFFER
                    for cid, f in list(self._recent.items()):
                        if f.used < idle and not f.readers:
                            self._release_recent(cid)
                    if not self._fetching:
                        self.buffers.trim()
                        release_free_heap()
            finally:
                self.flush_atimes()
                self._nursery = None
                nursery.cancel_scope.cancel()

    # -- space ----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self.chunk_bytes + self.local_bytes

    @property
    def capacity(self) -> int:
        """The configured size, or what the disk can hold now: what we use plus what is
        free, less a reserve (statvfs at most every 0.2 s, corrected by what we charged
        since)."""
        now = time.monotonic()
        if now - self._stat_at > 0.2:
            try:
                st = os.statvfs(self.root)
            except OSError:
                return self.configured
            self._stat_at = now
            self._disk_free = st.f_bavail * st.f_frsize
            self._used_at_stat = self.used
            self._reserve = disk_reserve(st.f_blocks * st.f_frsize)
        free = self._disk_free - (self.used - self._used_at_stat)
        return max(0, min(self.configured, self.used + free - self._reserve))

    def offer(self, token: object, free: Callable[[], int]) -> None:
        """Clean data outside the chunk index that may be dropped for room, after every
        unpinned chunk: `free()` drops it if it still can and returns the bytes freed."""
        self._offered[token] = free
        self._offered.move_to_end(token)
        self._room_freed()

    def _room_freed(self) -> None:
        self._room.set()
        self._room = trio.Event()

    async def room_freed(self) -> None:
        """Until some space is freed or becomes evictable."""
        await self._room.wait()

    @property
    def crowded(self) -> bool:
        """Whether write-back should upload closed files now rather than after its delay:
        a writer waits for room, or dirty and pinned data fill most of the cache."""
        return self.waiting_for_room > 0 or self.used > CROWDED * self.capacity

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

    def headroom(self) -> int:
        """Bytes of the budget not used now."""
        return max(0, self.capacity - self.used)

    def charge_anyway(self, nbytes: int) -> None:
        """Account `nbytes` already written outside the chunk index (by the kernel,
        passthrough): evict what can go for them, and count them even beyond the budget."""
        self.make_room(nbytes)
        self.local_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.local_bytes -= nbytes
        self._room_freed()

    # -- lookups --------------------------------------------------------------------------

    def chunk_len(self, obj_size: int, idx: int) -> int:
        return max(0, min(self.chunk_size, obj_size - idx * self.chunk_size))

    def cached(self, key: str, etag: str, idx: int) -> Chunk | None:
        return self._index.get((key, etag, idx))

    def busy(self, key: str, etag: str, idx: int) -> bool:
        """Cached, in memory or being fetched: nothing to start for it."""
        cid = (key, etag, idx)
        return cid in self._index or cid in self._fetching or cid in self._recent

    def _touch(self, cid: ChunkId, ch: Chunk) -> None:
        if cid in self._lru:
            self._lru.move_to_end(cid)
        if cid in self._near:
            self._near.move_to_end(cid)
        ch.atime = time.time()
        self._touched.add(ch.id)

    def _serve(self, ch: Chunk, start: int, n: int) -> memoryview:
        """Bytes of a cached chunk, the blocks they lie in read whole and verified against
        their checksums. A pread on the trio thread: usually a page-cache hit (microseconds,
        less than a thread hop), else the kernel's readahead of the file is under way."""
        first, last = start // VERIFY_BLOCK, (start + n - 1) // VERIFY_BLOCK
        lo = first * VERIFY_BLOCK
        data = memoryview(os.pread(self._files.fd(ch.obj),
                                   min(ch.size, (last + 1) * VERIFY_BLOCK) - lo,
                                   ch.offset + lo))
        for b in range(first, last + 1):
            off = b * VERIFY_BLOCK - lo
            got = xxhash.xxh3_64_digest(data[off:off + VERIFY_BLOCK])
            if got != ch.sums[b * 8:b * 8 + 8]:
                raise CorruptChunk(f"chunk {ch.idx} of {ch.key!r} block {b}")
        return data[start - lo:start - lo + n]

    def block_sums_of(self, key: str, etag: str, idx: int, start: int, n: int
                      ) -> bytes | None:
        """The stored sums of a cached chunk's bytes [start, start+n), if it is cached and
        they are whole blocks (the last block may end at the chunk's end)."""
        ch = self._index.get((key, etag, idx))
        if (ch is None or start % VERIFY_BLOCK
                or ((start + n) % VERIFY_BLOCK and start + n != ch.size)):
            return None
        first, last = start // VERIFY_BLOCK, -(-(start + n) // VERIFY_BLOCK)
        return ch.sums[first * 8:last * 8]

    def read_cached(self, key: str, etag: str, idx: int) -> bytes | memoryview | None:
        """A whole cached chunk (verified), or None if it is not cached (or corrupt)."""
        recent = self._recent.get((key, etag, idx))
        if recent is not None and recent.view is not None:
            return bytes(recent.view[:recent.size])
        ch = self._index.get((key, etag, idx))
        if ch is None:
            return None
        try:
            return self._serve(ch, 0, ch.size)
        except CorruptChunk as e:
            self._corrupt(ch, e)
            return None

    def _corrupt(self, ch: Chunk, e: CorruptChunk) -> None:
        log.warning("cache file of %s fails its checksum: dropped, fetched again", e)
        self.stats.corrupt += 1
        self.remove(ch)

    async def read(self, key: str, etag: str, obj_size: int, idx: int, start: int, n: int,
                   source: ChunkSource | None = None, keep: bool = True,
                   previous: PreviousOwners = NO_PREVIOUS, near: bool = False,
                   volatile: bool = False) -> bytes | memoryview:
        """Bytes of one chunk: from memory (a download in flight or just done, started from
        `source` if needed: S3 when None), else this node's cache file. `keep`: a download
        becomes a cache file (`near`: in the near-cache's budget). `volatile`: the caller
        uses the bytes before it next awaits (a FUSE reply), so a view of a download
        buffer may be handed out instead of a copy."""
        cid = (key, etag, idx)
        end = start + n
        joined_failure = False
        for _ in range(4):
            recent = self._recent.get(cid)
            if recent is not None and recent.view is not None:
                self._recent.move_to_end(cid)
                recent.read_to = max(recent.read_to, end)
                recent.used = time.monotonic()
                ch = self._index.get(cid)
                if ch is not None:
                    self._touch(cid, ch)
                elif keep and not recent.keep and self._nursery is not None:
                    # Read from memory and now worth keeping (a hot remote chunk): it goes
                    # to disk from the buffer, without fetching it again.
                    log.debug("chunk %d of %r: its download in memory is kept after all "
                              "(near-cache: %s)", idx, key, near)
                    recent.keep, recent.near = True, near
                    self._landing.setdefault(cid, trio.Event())
                    self._nursery.start_soon(self._keep_later, recent)
                self._count(recent, n)
                view = recent.view[start:end]
                return view if volatile else bytes(view)
            ch = self._index.get(cid)
            if ch is not None:
                self._touch(cid, ch)
                try:
                    data = self._serve(ch, start, n)
                except CorruptChunk as e:
                    self._corrupt(ch, e)
                    continue
                self.stats.bytes_from_cache += n
                return data
            fetch = self._fetching.get(cid)
            mine = fetch is None or fetch.error is not None
            if mine:
                fetch = self._start(cid, obj_size, source or self.s3, keep, previous, near)
            assert fetch is not None
            try:
                data = await fetch.wait_for(start, end, volatile)
                self._count(fetch, n)
                return data
            except _Retry:
                continue
            except Exception:
                if mine or joined_failure:
                    raise
                # Someone else's download (a readahead) failed: try once ourselves, the
                # failure may be behind us.
                joined_failure = True
        raise StoreError(f"chunk {idx} of {key!r} could not be read")

    async def read_local(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                         n: int, previous: PreviousOwners = NO_PREVIOUS
                         ) -> bytes | memoryview:
        """Bytes of a chunk this node holds (or fetches from S3 to hold)."""
        return await self.read(key, etag, obj_size, idx, start, n, previous=previous)

    def _count(self, fetch: _Fetch, n: int) -> None:
        if fetch.source.from_peer:
            self.stats.bytes_from_peers += n
        else:
            self.stats.bytes_from_cache += n  # (this node's, while it downloads)

    async def ensure(self, key: str, etag: str, obj_size: int, idx: int,
                     previous: PreviousOwners = NO_PREVIOUS) -> Chunk | None:
        """The cached chunk, fetching it if needed (from a previous owner if one still has
        it, else from S3); None if the cache has no room to keep it."""
        cid = (key, etag, idx)
        joined_failure = False
        while True:
            ch = self._index.get(cid)
            if ch is not None:
                self._touch(cid, ch)
                return ch
            fetch = self._fetching.get(cid)
            mine = fetch is None or not fetch.keep
            if mine:
                if fetch is not None:
                    await fetch.done.wait()  # one we would not keep: wait, then fetch
                    continue
                fetch = self._start(cid, obj_size, self.s3, True, previous)
            assert fetch is not None
            await fetch.done.wait()
            if isinstance(fetch.error, _Retry):
                continue
            if fetch.error is not None:
                if mine or joined_failure:
                    raise fetch.error
                # Someone else's download (a readahead) failed: try once ourselves, the
                # failure may be behind us.
                joined_failure = True
                continue
            if fetch.result is None and cid not in self._index:
                return None

    def start(self, key: str, etag: str, obj_size: int, idx: int, *,
              source: ChunkSource | None = None, keep: bool = True,
              previous: PreviousOwners = NO_PREVIOUS, near: bool = False) -> bool:
        """Start fetching a chunk in the background if it is neither cached, in memory nor
        being fetched, and a buffer is free now (readahead never queues behind readers);
        whether it started."""
        cid = (key, etag, idx)
        if (cid in self._index or cid in self._fetching or cid in self._recent
                or self._nursery is None):
            return False
        # One buffer stays for readers: readahead never takes the last.
        buf = self.buffers.try_take(reserve=1) or self._reclaim(read_only=True)
        if buf is None:
            return False
        self._start(cid, obj_size, source or self.s3, keep, previous, near, buf=buf)
        return True

    def advise(self, key: str, etag: str, idx: int) -> None:
        """A sequential reader is coming to this cached chunk: have the kernel read its
        file into the page cache now (asynchronously), so that the reader's preads on the
        event loop are memory copies. (Measured on the cache disk: buffered reads behind
        the kernel's readahead beat O_DIRECT reads of any size, and staging chunks into
        download buffers in worker threads cost more CPU than it saved; see
        docs/benchmarks.md.)"""
        cid = (key, etag, idx)
        ch = self._index.get(cid)
        if ch is None or cid in self._recent or cid in self._advised:
            return
        self._advised[cid] = None
        if len(self._advised) > OPEN_CHUNKS:
            self._advised.popitem(last=False)
        try:
            os.posix_fadvise(self._files.fd(ch.obj), ch.offset, ch.size,
                             os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # (gone meanwhile: the reader fetches it again)

    def _reclaim(self, read_only: bool) -> mmap.mmap | None:
        """The buffer of a kept download that no reader needs from memory: the oldest one
        read to its end. Readahead (`read_only`) takes only that; a reader that waits
        takes next the oldest whose chunk is on the cache disk (what is left of it is read
        there), then the oldest. (Taking the oldest first took, under a slow reader,
        another node's chunk that the reader was in the middle of, while chunks on the disk
        kept their buffers: the rest of it came over the network again.)"""
        free = [(cid, f) for cid, f in self._recent.items() if not f.readers]
        for want in (lambda cid, f: f.read_to >= f.size,
                     lambda cid, f: cid in self._index, lambda cid, f: True):
            for cid, f in free:
                if want(cid, f):
                    return self._release_recent(cid, keep=True)
            if read_only:
                return None
        return None

    def _release_recent(self, cid: ChunkId, keep: bool = False) -> mmap.mmap | None:
        f = self._recent.pop(cid)
        buf, f.buf, f.view = f.buf, None, None
        assert buf is not None
        if keep:
            return buf
        self.buffers.give(buf)
        return None

    async def _take_buffer(self) -> mmap.mmap:
        """A buffer for a download a reader waits on: a free one, else the oldest kept
        download's, else wait for one."""
        while True:
            buf = self.buffers.try_take() or self._reclaim(read_only=False)
            if buf is not None:
                return buf
            await self.buffers.freed()

    def _start(self, cid: ChunkId, obj_size: int, source: ChunkSource, keep: bool,
               previous: PreviousOwners, near: bool = False,
               buf: mmap.mmap | None = None) -> _Fetch:
        fetch = _Fetch(cid, self.chunk_len(obj_size, cid[2]), obj_size, source, keep, near)
        self._fetching[cid] = fetch
        assert self._nursery is not None, "the chunk cache is not running"
        self._nursery.start_soon(self._download, fetch, obj_size, previous, buf)
        return fetch

    async def _download(self, fetch: _Fetch, obj_size: int, previous: PreviousOwners,
                        buf: mmap.mmap | None) -> None:
        cid = fetch.cid
        size = fetch.size
        reserved = False
        try:
            if fetch.keep and fetch.near:
                self._near_room(size)
            if fetch.keep:
                # Room is made now so that what is read is kept; without room it is read
                # through a buffer and not kept (the cache is full of pinned or dirty data).
                reserved = fetch.keep = self.make_room(size)
                if reserved:
                    self.chunk_bytes += size  # reserved while downloading
                    self._landing.setdefault(cid, trio.Event())
                else:
                    self.stats.bypass += 1
            fetch.buf = buf or await self._take_buffer()
            buf = None
            fetch.view = memoryview(fetch.buf)
            try:
                await self._fill(fetch, obj_size, previous)
                if fetch.keep:
                    fetch.result = await self._keep(fetch)
                    if fetch.near and fetch.result is not None:
                        self._near[cid] = None
                        self.near_bytes += size
            except BaseException as e:
                fetch.error = e if isinstance(e, Exception) else StoreError(
                    f"fetch of chunk {cid[2]} of {cid[0]!r} cancelled")
                raise
            finally:
                if reserved:
                    self.chunk_bytes -= size
                if fetch.error is None:
                    self._recent[cid] = fetch  # readers behind it read memory meanwhile
                    self._recent.move_to_end(cid)
                    self.buffers.nudge()  # a reader waiting for a buffer may take it
                else:
                    with trio.CancelScope(shield=True):
                        await fetch.drained()
                    fetch.view = None
                    self.buffers.give(fetch.buf)
                    fetch.buf = None
        except Exception as e:
            if fetch.error is None:
                fetch.error = e
            log.debug("fetch of chunk %d of %r failed: %s", cid[2], cid[0], e)
        finally:
            if buf is not None:
                self.buffers.give(buf)
            if self._fetching.get(cid) is fetch:  # (a failed one may be replaced already)
                del self._fetching[cid]
            if reserved:
                self._landed(cid)
            fetch.done.set()
            fetch.moved.set()

    async def _keep_later(self, fetch: _Fetch) -> None:
        """Write a completed download that is still in memory to the cache."""
        try:
            await self._keep_now(fetch)
        finally:
            self._landed(fetch.cid)

    def _landed(self, cid: ChunkId) -> None:
        """A chunk on its way to the disk got there (or will not)."""
        ev = self._landing.pop(cid, None)
        if ev is not None:
            ev.set()

    def _on_their_way(self, key: str, etag: str, size: int) -> list[trio.Event] | None:
        """The landings of the chunks this object version misses on disk, if every one
        of them is being written now (None if one is not: no use waiting)."""
        obj = self._objects.get((key, etag))
        have = obj.chunks if obj is not None else set()
        waits = []
        for idx in range(-(-size // self.chunk_size)):
            if idx not in have:
                ev = self._landing.get((key, etag, idx))
                if ev is None:
                    return None
                waits.append(ev)
        return waits

    def landing(self, key: str, etag: str, size: int) -> bool:
        """Whether this object misses chunks on disk that are all being written now."""
        return bool(self._on_their_way(key, etag, size))

    async def landed(self, key: str, etag: str, size: int, patience: float) -> None:
        """Wait (at most `patience` seconds) for the chunks of this object version that
        are being written to the cache disk, when they are all it misses there: an open
        after them can be passed through. At once if a chunk is not on its way."""
        with trio.move_on_after(patience):
            for ev in self._on_their_way(key, etag, size) or ():
                await ev.wait()

    async def _keep_now(self, fetch: _Fetch) -> None:
        cid, size = fetch.cid, fetch.size
        if cid in self._index or fetch.view is None:
            return
        if fetch.near:
            self._near_room(size)
        if not self.make_room(size):
            return
        self.chunk_bytes += size
        fetch.readers += 1  # its buffer is not taken while it is written
        try:
            fetch.result = await self._keep(fetch)
            if fetch.near and fetch.result is not None:
                self._near[cid] = None
                self.near_bytes += size
        except Exception as e:
            log.debug("keeping chunk %d of %r failed: %s", cid[2], cid[0], e)
        finally:
            fetch.readers -= 1
            self.chunk_bytes -= size

    async def _fill(self, fetch: _Fetch, obj_size: int, previous: PreviousOwners) -> None:
        """The chunk's bytes into its buffer: whole from a previous owner if one still has
        it (S3 downloads only), else piece by piece from its source, in parallel."""
        key, etag, idx = fetch.cid
        size = fetch.size
        assert fetch.view is not None
        if fetch.source is self.s3:
            data = await previous.from_previous(key, etag, obj_size, idx)
            if data is not None:
                if len(data) != size:
                    raise StaleObject(f"a peer sent {len(data)} bytes for chunk {idx} of "
                                      f"{key!r}, expected {size}")
                fetch.view[:size] = data
                fetch.fill_all()
                self.stats.bytes_fetched_from_peers += size
                return

        async def piece(i: int) -> None:
            assert fetch.view is not None
            s, e = fetch.pieces[i]
            await fetch.source.fill(fetch.cid, obj_size, s, fetch.view[s:e],
                                    lambda n: fetch.advance(i, n))
            fetch.advance(i, e - s)

        with first_error():
            async with trio.open_nursery() as n:
                for i in range(len(fetch.pieces)):
                    n.start_soon(piece, i)
        if fetch.source.from_peer:
            self.stats.bytes_fetched_from_peers += size
        else:
            self.stats.bytes_from_s3 += size

    async def _keep(self, fetch: _Fetch) -> Chunk | None:
        """Checksum a complete chunk and write it into its object's file (in a thread);
        it is a cache hit from then on. None if the object's file went meanwhile (the
        version was dropped: nothing to keep)."""
        assert fetch.view is not None
        data, size = fetch.view, fetch.size
        key, etag, idx = fetch.cid
        obj = self._obj_for(key, etag, fetch.obj_size)
        offset = idx * self.chunk_size

        def work() -> bytes:
            sums = block_sums(data[:size])
            _write_chunk(obj.path, offset, data, size, obj.size)
            return sums

        try:
            sums = await trio.to_thread.run_sync(work, limiter=self.disk)
        except FileNotFoundError:
            return None
        if self._objects.get((key, etag)) is not obj:
            return None
        return self._adopt(obj, fetch.cid, size, sums)

    def _adopt(self, obj: ObjFile, cid: ChunkId, size: int, sums: bytes) -> Chunk:
        """Index chunk `cid`, now written into its object's file."""
        key, etag, idx = cid
        now = time.time()
        cur = self.db.execute(
            "INSERT OR REPLACE INTO chunks (key, etag, idx, size, atime, sums, obj) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, etag, idx, size, now, sums, obj.id))
        ch = Chunk(int(cur.lastrowid or 0), key, etag, idx, size, now, obj,
                   idx * self.chunk_size, sums)
        self._insert(ch)
        return ch

    def _adopt_whole(self, tmp: str, key: str, etag: str, size: int, sums: bytes) -> None:
        """A small object written whole to `tmp` becomes its version's file (chunk 0)."""
        obj = self._objects.get((key, etag))
        if obj is not None and (obj.chunks or obj.holds or obj.size != size):
            os.unlink(tmp)
            return
        if obj is None:
            obj = self._obj_for(key, etag, size)
        os.rename(tmp, obj.path)
        self._files.drop(obj)
        self._adopt(obj, (key, etag, 0), size, sums)

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
                data = os.pread(fd, listed_size, 0) if got is not None else b""
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
        if n == info.size and n and cid not in self._index and cid not in self._fetching:
            self.stats.bytes_from_s3 += n
            self._adopt_whole(tmp, key, info.etag, n, block_sums(memoryview(data)[:n]))
        else:
            os.unlink(tmp)
        return info

    async def head_by_get_many(self, store: ObjectStore, items: Sequence[tuple[str, int]],
                               each: Callable[[str, ObjectInfo | None | Exception], None]
                               ) -> None:
        """`head_by_get` of many small objects (key, listed size) in one store batch:
        `each(key, answer)` as `ObjectStore.head_many` says it. Their chunk files are
        written by one worker-thread hop and indexed in one SQLite transaction, where one
        at a time cost the event loop four file calls and a commit each."""
        total = sum(n for _, n in items)
        if not self.make_room(total):
            await store.head_many([k for k, _ in items], each)
            return
        got: list[tuple[ObjectInfo, bytes]] = []

        def answered(key: str, answer: tuple[ObjectInfo, bytes] | None | Exception) -> None:
            if isinstance(answer, tuple):
                got.append(answer)
            else:
                each(key, answer)

        self.chunk_bytes += total  # reserved while downloading
        try:
            await store.get_small_many(items, answered)
            whole = [(info, data) for info, data in got if len(data) == info.size]
            tmps = [self._tmp_path() for _ in whole]
            sums = await trio.to_thread.run_sync(_write_files, tmps, [d for _, d in whole],
                                                 limiter=self.disk)
        finally:
            self.chunk_bytes -= total
        # From here no await: the index and the database change together.
        self.db.execute("BEGIN")
        try:
            for (info, data), tmp, sum_ in zip(whole, tmps, sums, strict=True):
                cid = (info.key, info.etag, 0)
                if cid in self._index or cid in self._fetching or not data:
                    os.unlink(tmp)
                    continue
                self.stats.bytes_from_s3 += len(data)
                self._adopt_whole(tmp, info.key, info.etag, len(data), sum_)
        finally:
            self.db.execute("COMMIT")
        for info, _ in got:
            each(info.key, info)

    # -- by path ---------------------------------------------------------------------------

    async def landed_under(self, prefix: str, patience: float) -> None:
        """Until the chunks of `prefix` (or under it) on their way to the disk are there
        (`patience` seconds at most): an eviction right after a read drops them too."""
        with trio.move_on_after(patience):
            for cid, ev in list(self._landing.items()):
                if not prefix or cid[0] == prefix or cid[0].startswith(prefix + "/"):
                    await ev.wait()

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
        self._forget_recent(key, keep_etag)

    def _forget_recent(self, key: str, keep_etag: str | None) -> None:
        for cid in [c for c in self._recent if c[0] == key and c[1] != keep_etag]:
            if not self._recent[cid].readers:
                self._release_recent(cid)

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str) -> None:
        """After a server-side copy the bytes are the same: keep them under the new name
        (the object's file with them; if the new version has a file already, the old
        one's chunks go)."""
        self._forget_recent(old_key, None)
        obj = self._objects.get((old_key, old_etag))
        if obj is None or (old_key, old_etag) == (new_key, new_etag):
            return
        chunks = [self._index[(old_key, old_etag, idx)] for idx in sorted(obj.chunks)]
        if (new_key, new_etag) in self._objects:
            for ch in chunks:
                self.remove(ch)
            return
        for ch in chunks:
            self._remove_index_only(ch)
        del self._objects[(old_key, old_etag)]
        obj.key, obj.etag = new_key, new_etag
        self._objects[(new_key, new_etag)] = obj
        self.db.execute("UPDATE objects SET key=?, etag=? WHERE id=?",
                        (new_key, new_etag, obj.id))
        for ch in chunks:
            ch.key, ch.etag = new_key, new_etag
            self.db.execute("UPDATE chunks SET key=?, etag=? WHERE id=?",
                            (new_key, new_etag, ch.id))
            self._insert(ch)

    def chunk_count(self) -> int:
        return len(self._index)

    def chunks_landing(self) -> int:
        """Chunks read (or being read) that are on their way to a cache file: served
        from memory meanwhile, counted by `chunk_count` once they are on disk."""
        return len(self._landing)
