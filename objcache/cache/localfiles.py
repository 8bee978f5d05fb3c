"""The write-back store: local data files for new and modified files, and their journal.

A written file lives in local/<fid> until the flusher has uploaded it. A file modified in
place keeps a reference to the S3 version it started from (its base); chunks the writer
never touched are read from that version through the chunk cache, so opening a 10 GiB
object to change one byte does not download 10 GiB. Every state change that a restart
needs (creation, first change, chunk materialization, truncate, close, upload) is committed
to the state database before the FUSE call returns, so `kill -9` loses no closed file.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat as stat_mod
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import trio
import xxhash

from objcache.cache.statedb import StateDB
from objcache.entries import Attrs
from objcache.errors import NoSpace

if TYPE_CHECKING:
    from objcache.cache.chunks import ChunkCache
    from objcache.cache.router import ChunkRouter

log = logging.getLogger(__name__)

FILL_PIECE = 8 << 20
# What a digest reads at a time. Its buffer is new anonymous memory at every call (see
# `digests_of`), and the kernel faults in and zeroes every page of it: with FILL_PIECE, a
# streaming upload's or a staged piece's digest of 8 MiB cost 0.58-0.79 s of CPU per GiB
# in its own calls, against 0.22 s with one buffer for them all; 256 KiB costs 0.25 s.
DIGEST_PIECE = 256 << 10
# A file written through passthrough, by an open that could map it shared and writable
# (O_RDWR), is still looked at this long after its last writer closed it: a shared mapping
# outlives the close, and the kernel tells us nothing of the writes through it.
BYPASS_WATCH = 60.0


def _pack(chunks: set[int]) -> bytes:
    if not chunks:
        return b""
    bits = bytearray((max(chunks) >> 3) + 1)
    for i in chunks:
        bits[i >> 3] |= 1 << (i & 7)
    return bytes(bits)


def _unpack(blob: bytes) -> set[int]:
    return {i * 8 + b for i, byte in enumerate(blob) for b in range(8) if byte >> b & 1}


def _digest(f: BinaryIO, start: int, length: int, view: memoryview) -> bytes:
    # Read into one reused buffer: 0.11 s per GiB from the page cache here, against 0.27 s
    # with a new bytes object per read. (Not a mapping of the file, faster still: a
    # truncate while the mapping is read would kill the daemon with SIGBUS.)
    h = xxhash.xxh3_128()
    f.seek(start)
    while length > 0:
        n = f.readinto(view[:min(length, len(view))])
        if not n:
            break
        h.update(view[:n])
        length -= n
    return h.digest()


def digests_of(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The digest of each byte range [start, end) of the file at `path` (in a worker
    thread). The buffer is as big as the longest range needs, up to DIGEST_PIECE, and
    anonymous memory of its own that goes back to the system when done: a bytearray of
    FILL_PIECE for every closed file (even of 1 KiB) was carved from the worker thread's
    malloc arena and left each arena 8 MiB larger for good (malloc_trim does not shrink
    a thread's arena): 3-9 of them, 24-70 MB, in every daemon that wrote files."""
    longest = max((end - start for start, end in ranges), default=0)
    with mmap.mmap(-1, max(1, min(DIGEST_PIECE, longest))) as buf, memoryview(buf) as view, \
            open(path, "rb", buffering=0) as f:
        return [_digest(f, start, end - start, view) for start, end in ranges]


def _copy_file(src_path: str, dst_path: str) -> None:
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
        n = os.fstat(src.fileno()).st_size
        off = 0
        while off < n:
            off += os.copy_file_range(src.fileno(), dst.fileno(), n - off)


_ASIDE = "\0aside/"  # the journal key of a file set aside (never an S3 key)


class LocalFile:
    """Attributes:
    version: bumped by every change; an upload clears `dirty` only if it is unchanged.
    writers: open handles that may write; the flusher waits until there are none.
    lock: held while uploading, renaming or removing, so these never interleave.
    sealed: bytes below this offset were handed to a streaming upload and must not change;
        a write or truncate below it (or a rename) sets `seal_broken`, and the upload falls
        back to sending the whole file. 0 when nothing is sealed.
    bypass: writers whose writes the kernel makes to the data file without us
        (passthrough); `observe` takes in what they did. `seen`: the data file's (size,
        mtime, ctime) as last taken in.
    shared: the data file is also a sealed blob's (a hard link): a write first gives the
        working copy a file of its own (`unshare`).
    linked: the same, for a file the kernel writes without us: the working copy keeps its
        file (the kernel's backing file, maybe mapped still) and the blob is given one of
        its own before the next writer (`unshare` awaits `linked()`).
    """

    __slots__ = ("fid", "key", "path", "base_key", "base_etag", "base_size", "base_limit",
                 "materialized", "size", "mode", "uid", "gid", "mtime_ns", "atime_ns",
                 "ctime_ns", "dirty", "aside",
                 "dirty_since", "etag", "version", "writers", "opens", "lock", "fd",
                 "last_change", "removed", "charged", "urgent", "shared", "unsharing",
                 "sealed", "seal_broken", "bypass", "mappable", "seen", "watch_until", "linked")

    def __init__(self, fid: int, key: str, path: str) -> None:
        self.fid = fid
        self.key = key
        self.path = path
        self.base_key: str | None = None
        self.base_etag: str | None = None
        self.base_size = 0
        self.base_limit = 0
        self.materialized: set[int] = set()
        self.size = 0
        self.mode = stat_mod.S_IFREG | 0o644
        self.uid = 0
        self.gid = 0
        self.mtime_ns = 0
        self.atime_ns = 0
        self.ctime_ns = 0
        self.dirty = False
        self.dirty_since: float | None = None
        self.etag: str | None = None
        self.version = 0
        self.aside = False  # no longer shows its key (`LocalFiles.set_aside`)
        self.writers = 0
        self.opens = 0
        self.lock = trio.Lock()
        self.fd = -1
        self.last_change = 0.0
        self.removed = False
        self.charged = 0
        self.urgent = False
        self.shared = False
        self.linked: Callable[[], Awaitable[None]] | None = None
        self.unsharing: trio.Event | None = None  # set when a copy under way is done
        self.sealed = 0
        self.seal_broken = False
        self.bypass = 0
        self.mappable = False  # a writer that bypasses us could map it (see bypass_opened)
        self.seen: tuple[int, int, int] | None = None
        self.watch_until = 0.0

    @property
    def attrs(self) -> Attrs:
        return Attrs(self.mode, self.uid, self.gid, self.mtime_ns, self.atime_ns,
                     self.ctime_ns)

    def set_attrs(self, a: Attrs) -> None:
        self.mode, self.uid, self.gid = a.mode, a.uid, a.gid
        self.mtime_ns, self.atime_ns, self.ctime_ns = a.mtime_ns, a.atime_ns, a.ctime_ns

    def modified(self) -> None:
        """The content changed now: mtime and ctime move (POSIX)."""
        self.mtime_ns = self.ctime_ns = time.time_ns()


class LocalFiles:
    """Attributes:
    space: the cache whose budget local files are charged to (and which may evict clean,
        closed ones for room).
    reader: reads base versions (through the cluster's owners when there is a cluster).
    wait_budget: how long a write that needs room waits while write-back frees none
        (then ENOSPC); a write that can never fit gets ENOSPC at once.
    """

    def __init__(self, db: StateDB, root: Path, space: ChunkCache,
                 reader: ChunkRouter, wait_budget: float = 60.0) -> None:
        self.db = db
        self.file_gone = space.file_gone  # (the same listener: see ChunkCache)
        self.root = root / "local"
        self.root.mkdir(parents=True, exist_ok=True)
        self.space = space
        self.reader = reader
        self.cs = space.chunk_size
        self.by_key: dict[str, LocalFile] = {}
        self.changed = trio.Event()  # set when a file becomes dirty or closes (wakes flusher)
        self.wait_budget = wait_budget  # seconds a write waits without any room freed
        self._charging: set[int] = set()  # files being made room for (never evicted)
        self.watched: set[LocalFile] = set()  # files written without us (see `observe`)
        self._load()

    # -- journal --------------------------------------------------------------------------

    def _load(self) -> None:
        rows = self.db.execute(
            "SELECT fid, key, base_key, base_etag, base_size, base_limit, materialized, size, "
            "mode, uid, gid, mtime_ns, atime_ns, ctime_ns, dirty, dirty_since, etag "
            "FROM files").fetchall()
        known = set()
        for (fid, key, bkey, betag, bsize, blimit, mat, _size, mode, uid, gid, mtime_ns,
             atime_ns, ctime_ns, dirty, dirty_since, etag) in rows:
            lf = LocalFile(fid, key, str(self.root / str(fid)))
            if key.startswith(_ASIDE):  # set aside, then the daemon stopped: nobody's
                self.db.execute("DELETE FROM files WHERE fid=?", (fid,))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lf.path)
                continue
            try:
                # The data file is the truth for the size: writes after the last journal
                # update (an unclosed file at a crash) are in it too.
                st = os.stat(lf.path)
                lf.size = st.st_size
                if st.st_nlink > 1 and not dirty:
                    # Also a sealed blob's file (a close's hard link, before the working
                    # copy went): the blob keeps it; writing it here would change the blob.
                    os.unlink(lf.path)
                    raise FileNotFoundError(lf.path)
            except FileNotFoundError:
                if dirty:
                    log.error("local data of dirty file %r is missing from the cache dir", key)
                self.db.execute("DELETE FROM files WHERE fid=?", (fid,))
                continue
            lf.base_key, lf.base_etag, lf.base_size, lf.base_limit = bkey, betag, bsize, blimit
            lf.materialized = _unpack(mat)
            lf.set_attrs(Attrs(mode, uid, gid, mtime_ns, atime_ns, ctime_ns))
            lf.dirty, lf.dirty_since, lf.etag = bool(dirty), dirty_since, etag
            lf.version = 1 if dirty else 0
            lf.charged = lf.size
            self.space.local_bytes += lf.size
            self.by_key[key] = lf
            known.add(str(fid))
            if not lf.dirty:
                self._offer(lf)
        for f in self.root.iterdir():
            if f.name not in known:
                f.unlink()
        n = sum(1 for lf in self.by_key.values() if lf.dirty)
        if n:
            log.info("recovered %d dirty files from the journal", n)

    def _save(self, lf: LocalFile) -> None:
        self.db.execute(
            "UPDATE files SET key=?, base_key=?, base_etag=?, base_size=?, base_limit=?, "
            "materialized=?, size=?, mode=?, uid=?, gid=?, mtime_ns=?, atime_ns=?, ctime_ns=?, "
            "dirty=?, dirty_since=?, etag=? WHERE fid=?",
            (_ASIDE + str(lf.fid) if lf.aside else lf.key, lf.base_key, lf.base_etag,
             lf.base_size, lf.base_limit,
             _pack(lf.materialized), lf.size, lf.mode, lf.uid, lf.gid, lf.mtime_ns,
             lf.atime_ns, lf.ctime_ns, int(lf.dirty), lf.dirty_since, lf.etag, lf.fid))

    def create(self, key: str, a: Attrs, base: tuple[str, str, int] | None = None,
               etag: str | None = None) -> LocalFile:
        """A new local file with attributes `a`: empty, or standing in for the S3 version
        `base` (key, etag, size) without copying its bytes yet."""
        cur = self.db.execute(
            "INSERT INTO files (key, base_key, base_etag, base_size, base_limit, materialized, "
            "size, mode, uid, gid, mtime_ns, atime_ns, ctime_ns, dirty, dirty_since, etag) "
            "VALUES (?, NULL, NULL, 0, 0, x'', 0, ?, ?, ?, ?, ?, ?, 0, NULL, ?)",
            (key, a.mode, a.uid, a.gid, a.mtime_ns, a.atime_ns, a.ctime_ns, etag))
        fid = int(cur.lastrowid or 0)
        lf = LocalFile(fid, key, str(self.root / str(fid)))
        lf.set_attrs(a)
        lf.etag = etag
        fd = os.open(lf.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        if base is not None:
            lf.base_key, lf.base_etag, lf.base_size = base
            lf.base_limit = lf.size = base[2]
            os.ftruncate(fd, lf.size)
            if not self.space.charge(lf.size):
                os.close(fd)
                os.unlink(lf.path)
                self.db.execute("DELETE FROM files WHERE fid=?", (fid,))
                raise NoSpace(f"{key}: no room in the cache for a working copy")
            lf.charged = lf.size
        lf.fd = fd
        self._save(lf)
        self.by_key[key] = lf
        return lf

    def adopt(self, key: str, a: Attrs, path: str, size: int, etag: str) -> LocalFile:
        """A clean working copy made of `path`, a whole copy of S3 version `etag` that
        the chunk cache handed over: it is moved here, not copied."""
        cur = self.db.execute(
            "INSERT INTO files (key, base_key, base_etag, base_size, base_limit, materialized, "
            "size, mode, uid, gid, mtime_ns, atime_ns, ctime_ns, dirty, dirty_since, etag) "
            "VALUES (?, NULL, NULL, 0, 0, x'', ?, ?, ?, ?, ?, ?, ?, 0, NULL, ?)",
            (key, size, a.mode, a.uid, a.gid, a.mtime_ns, a.atime_ns, a.ctime_ns, etag))
        lf = LocalFile(int(cur.lastrowid or 0), key, "")
        lf.path = str(self.root / str(lf.fid))
        os.rename(path, lf.path)
        lf.set_attrs(a)
        lf.etag = etag
        lf.size = lf.charged = size
        self.space.charge_anyway(size)  # (the cache released them as chunks)
        self.by_key[key] = lf
        return lf

    def _fd(self, lf: LocalFile) -> int:
        if lf.fd < 0:
            lf.fd = os.open(lf.path, os.O_RDWR)
        return lf.fd

    def mark_dirty(self, lf: LocalFile) -> None:
        lf.version += 1
        lf.last_change = time.monotonic()
        if not lf.dirty:
            lf.dirty = True
            lf.dirty_since = time.time()
            self._save(lf)

    async def _charge(self, lf: LocalFile, new_size: int) -> None:
        """Account the file's growth to `new_size` in the cache's budget: evicting clean
        data, else waiting for write-back to make dirty data clean (backpressure)."""
        grow = new_size - lf.charged
        if grow <= 0:
            return
        self._charging.add(lf.fid)
        try:
            if not self.space.charge(grow):
                await self._wait_for_room(lf, grow)
        finally:
            self._charging.discard(lf.fid)
        lf.charged += grow

    async def _wait_for_room(self, lf: LocalFile, grow: int) -> None:
        space = self.space
        start = last_freed = time.monotonic()
        space.waiting_for_room += 1
        self.changed.set()  # the write-back loop looks again: the cache is crowded now
        log.info("a write to %r waits for write-back to free %d bytes of cache", lf.key,
                 grow)
        try:
            while not space.charge(grow):
                stuck = space.pinned_bytes + sum(
                    f.charged for f in self.by_key.values()
                    if f.writers or f.fid in self._charging)
                if grow + stuck > space.capacity:
                    raise NoSpace(f"{lf.key}: {grow} more bytes can never fit in the "
                                  f"{space.capacity}-byte cache: {stuck} bytes are pinned or "
                                  "in files open for writing")
                left = last_freed + self.wait_budget - time.monotonic()
                if left <= 0:
                    log.error("a write to %r gives up (ENOSPC): write-back freed no cache "
                              "space for %.0fs (S3 refusing uploads?)", lf.key,
                              self.wait_budget)
                    raise NoSpace(f"{lf.key}: write-back freed no cache space for "
                                  f"{self.wait_budget:.0f}s")
                with trio.move_on_after(left):
                    await space.room_freed()
                    last_freed = time.monotonic()
        finally:
            space.waiting_for_room -= 1
            waited = time.monotonic() - start
            space.stats.write_waits += 1
            space.stats.write_wait_seconds += waited
            if waited > 1.0:
                log.info("a write to %r waited %.1fs for write-back", lf.key, waited)

    def hand_over_charge(self, lf: LocalFile) -> int:
        """The file's bytes are now accounted elsewhere (its data file became a sealed
        blob, which charges them): stop charging them here; the bytes released."""
        n, lf.charged = lf.charged, 0
        self.space.release(n)
        return n

    # -- data -----------------------------------------------------------------------------

    async def _materialize(self, lf: LocalFile, idx: int) -> None:
        """Copy chunk `idx` of the base version into the local file before it is changed."""
        if idx in lf.materialized or idx * self.cs >= lf.base_limit:
            return
        assert lf.base_key is not None and lf.base_etag is not None
        start = idx * self.cs
        n = min(self.cs, lf.base_limit - start)
        data = await self.reader.read(lf.base_key, lf.base_etag, lf.base_size, start, n)
        if idx in lf.materialized or lf.removed:  # another writer got here first
            return
        os.pwrite(self._fd(lf), data, start)
        lf.materialized.add(idx)
        self._save(lf)

    async def materialize_all(self, lf: LocalFile) -> None:
        for idx in range((lf.base_limit + self.cs - 1) // self.cs):
            await self._materialize(lf, idx)

    async def unshare(self, lf: LocalFile) -> None:
        """Before the file changes: a data file that is also a sealed blob's stops being
        one (`shared`: the working copy gets a copy of its own; `linked`: the blob does).
        Concurrent writers wait for one copy: none may write the blob meanwhile."""
        while lf.shared or lf.linked is not None:
            if lf.unsharing is not None:
                await lf.unsharing.wait()
                continue
            lf.unsharing = done = trio.Event()
            try:
                await self._charge(lf, lf.size)  # the copy's bytes (the blob has its own)
                if lf.linked is not None:
                    linked = lf.linked
                    await linked()
                    if lf.linked is linked:
                        # (a close may have sealed the file again meanwhile: that blob's
                        # detach is the loop's next)
                        lf.linked = None
                    continue
                # copy_file_range (reflinked or in-kernel), in a thread: a checkpoint
                # rewritten after close may be gigabytes.
                await trio.to_thread.run_sync(_copy_file, lf.path, lf.path + ".unshare",
                                              limiter=self.space.disk)
                os.rename(lf.path + ".unshare", lf.path)
                if lf.fd >= 0:
                    os.close(lf.fd)
                    lf.fd = -1
                lf.shared = False
            finally:
                lf.unsharing = None
                done.set()

    async def write(self, lf: LocalFile, offset: int, data: bytes) -> int:
        await self.unshare(lf)
        end = offset + len(data)
        if lf.base_limit:
            for idx in range(offset // self.cs, (min(end, lf.base_limit) - 1) // self.cs + 1):
                await self._materialize(lf, idx)
        # A write adds at most its own length: one into a hole left by a truncate that
        # grew the file charges what it fills, not the whole hole.
        await self._charge(lf, min(max(end, lf.size), lf.charged + len(data)))
        n = os.pwrite(self._fd(lf), data, offset)
        if offset < lf.sealed:
            lf.seal_broken = True
        if end > lf.size:
            if end // self.cs != lf.size // self.cs:
                self.changed.set()  # a chunk is complete: streaming write-back may send it
            lf.size = end
        lf.modified()
        self.mark_dirty(lf)
        return n

    async def truncate(self, lf: LocalFile, size: int) -> None:
        await self.unshare(lf)
        if size < lf.base_limit:
            if size % self.cs:
                await self._materialize(lf, size // self.cs)
            lf.base_limit = size
        # Growing makes a hole (sparse in the data file): it needs no cache space until
        # written, so a preallocating truncate of a file larger than the cache works.
        os.ftruncate(self._fd(lf), size)
        if size < lf.sealed:
            lf.seal_broken = True
        lf.size = size
        lf.modified()
        self.mark_dirty(lf)
        self._save(lf)
        self._seen_now(lf)

    async def fill(self, lf: LocalFile, size: int,
                   piece: Callable[[int, int], Awaitable[bytes]]) -> None:
        """Give an empty local file `size` bytes of content, read piece by piece."""
        await self._charge(lf, size)
        fd = self._fd(lf)
        for off in range(0, size, FILL_PIECE):
            os.pwrite(fd, await piece(off, min(FILL_PIECE, size - off)), off)
        lf.size = size
        self._save(lf)

    async def read(self, lf: LocalFile, offset: int, length: int) -> bytes:
        end = min(offset + length, lf.size)
        if offset >= end:
            return b""
        if not lf.base_limit or offset >= lf.base_limit:
            return os.pread(self._fd(lf), end - offset, offset)
        parts: list[bytes] = []
        while offset < end:
            idx = offset // self.cs
            stop = min(end, (idx + 1) * self.cs)
            if idx in lf.materialized or offset >= lf.base_limit:
                parts.append(os.pread(self._fd(lf), stop - offset, offset))
            else:
                from_base = min(stop, lf.base_limit)
                assert lf.base_key is not None and lf.base_etag is not None
                parts.append(await self.reader.read(lf.base_key, lf.base_etag, lf.base_size,
                                                    offset, from_base - offset))
                if stop > from_base:  # past a truncation point inside this chunk: zeros
                    parts.append(bytes(stop - from_base))
            offset = stop
        return b"".join(parts)

    # -- writes that bypass us -----------------------------------------------------------

    def _stat(self, lf: LocalFile) -> tuple[tuple[int, int, int], int] | None:
        """((size, mtime, ctime), bytes allocated) of the data file. Only the first tell
        a change: the file system allocates blocks (extents, at writeback) long after
        the write that needed them."""
        try:
            st = os.stat(lf.path)
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns), st.st_blocks * 512

    def bypass_opened(self, lf: LocalFile, mappable: bool) -> None:
        """A writer whose writes go to the data file without us (passthrough) opened it;
        `mappable`: for reading and writing, so it may map the file shared and writable."""
        if lf.bypass == 0 and lf not in self.watched:
            self._seen_now(lf, watched=False)
        lf.bypass += 1
        lf.mappable = lf.mappable or mappable
        self.watched.add(lf)

    def bypass_closed(self, lf: LocalFile) -> None:
        self.observe(lf)
        lf.bypass -= 1
        if lf.bypass == 0:
            if lf.mappable:
                lf.watch_until = time.monotonic() + BYPASS_WATCH
            else:
                # No open that bypassed us could map it for writing (mmap needs O_RDWR
                # for that): nothing writes it without us from now on. Watched for
                # BYPASS_WATCH, each such file was looked at several times a second (a
                # writer of 20 files a second watched 1,250 at once, and its heap grew
                # with them, at 32 nodes: docs/benchmarks.md).
                self.watched.discard(lf)

    def observe(self, lf: LocalFile) -> bool:
        """Take in what writes that bypassed us (passthrough, a shared mapping) did to a
        watched file: its size and times become the data file's, and a change makes it
        dirty (a new version: an upload racing it does not mark it clean). True if it
        changed."""
        if lf not in self.watched:
            return False
        if lf.removed or (not lf.bypass and time.monotonic() > lf.watch_until):
            self.watched.discard(lf)
        got = self._stat(lf)
        # A write moves the mtime (the kernel takes a fine-grained one once we have looked
        # at it); the ctime alone moves with the data file's links too (sealed blobs).
        if got is None or (lf.seen is not None and got[0][:2] == lf.seen[:2]):
            return False
        lf.seen, allocated = got
        old = lf.size
        lf.size, lf.mtime_ns, lf.ctime_ns = lf.seen
        grow = min(allocated, lf.size) - lf.charged  # (a hole takes no room)
        if grow > 0:  # on the disk already: accounted even beyond the budget
            self.space.charge_anyway(grow)
            lf.charged += grow
        if lf.size // self.cs != old // self.cs:
            self.changed.set()  # a chunk is complete: streaming write-back may send it
        self.mark_dirty(lf)
        return True

    def bypassed(self, lf: LocalFile) -> bool:
        """Whether writes to the file may come without us seeing them."""
        return lf in self.watched

    async def digest(self, lf: LocalFile, start: int, length: int) -> bytes:
        """A digest of bytes [start, start+length) of the data file (in a thread): what
        a streaming upload sent of a file written without us is checked against it."""
        return (await self.digests(lf.path, [(start, start + length)]))[0]

    async def digests(self, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """`digests_of` in a thread."""
        return await trio.to_thread.run_sync(digests_of, path, ranges,
                                             limiter=self.space.disk)

    def observe_all(self) -> None:
        for lf in list(self.watched):
            self.observe(lf)

    def _seen_now(self, lf: LocalFile, watched: bool = True) -> None:
        """We changed a watched file ourselves (or start watching it): what it looks
        like now is not news."""
        if watched and lf not in self.watched:
            return
        got = self._stat(lf)
        lf.seen = got[0] if got is not None else None

    def save(self, lf: LocalFile) -> None:
        """Journal size and attributes (close, chmod, ...)."""
        if not lf.removed:
            self._save(lf)

    # -- lifecycle ------------------------------------------------------------------------

    def mark_clean(self, lf: LocalFile, etag: str) -> None:
        """The S3 object `lf.key` now holds exactly this content."""
        lf.dirty = False
        lf.dirty_since = None
        lf.urgent = False
        lf.etag = etag
        # The uploader materialized every base chunk first, so the local file is complete
        # and no longer needs the base version (which the upload may have overwritten).
        lf.base_key, lf.base_etag, lf.base_size, lf.base_limit = None, None, 0, 0
        lf.materialized = set()
        self._save(lf)
        if lf.opens == 0:
            self._offer(lf)

    def rekey(self, lf: LocalFile, new_key: str) -> None:
        """`lf` is now the file at `new_key` (a rename); what was there is replaced."""
        displaced = self.by_key.get(new_key)
        if displaced is not None and displaced is not lf:
            self.remove(displaced)
        del self.by_key[lf.key]
        lf.key = new_key
        lf.seal_broken = lf.seal_broken or lf.sealed > 0  # a multipart upload has one key
        self.by_key[new_key] = lf
        self._save(lf)

    def set_aside(self, lf: LocalFile) -> None:
        """`lf` (clean, still open here) no longer shows its key: another node committed a
        newer version. New opens and reads by name see that version; the handles that
        have `lf` open keep it, and a write and close through them commits it (the last
        close wins). Forgotten (`remove`) when its last handle closes."""
        if self.by_key.get(lf.key) is lf:
            del self.by_key[lf.key]
        # Its row stays (under a key no file has: the key is UNIQUE, and a new working
        # copy of the key may come), so that its fid, which names its data file, is not
        # handed to another file while it lives.
        lf.aside = True
        self._save(lf)

    def remove(self, lf: LocalFile) -> None:
        """Forget the file; its data goes once no handle has it open."""
        if lf.removed:
            return
        lf.removed = True
        if self.by_key.get(lf.key) is lf:
            del self.by_key[lf.key]
        self.db.execute("DELETE FROM files WHERE fid=?", (lf.fid,))
        if lf.opens == 0:
            self._drop_data(lf)

    def _drop_data(self, lf: LocalFile) -> None:
        self.watched.discard(lf)
        self.file_gone(lf.path)
        if lf.fd >= 0:
            os.close(lf.fd)
            lf.fd = -1
        try:
            os.unlink(lf.path)
        except FileNotFoundError:
            pass
        self.space.release(lf.charged)
        lf.charged = 0

    def opened(self, lf: LocalFile, writable: bool) -> None:
        lf.opens += 1
        if writable:
            lf.writers += 1

    def closed(self, lf: LocalFile, writable: bool) -> None:
        lf.opens -= 1
        if writable:
            lf.writers -= 1
        if lf.opens == 0:
            if lf.removed:
                self._drop_data(lf)
            else:
                if lf.fd >= 0:
                    os.close(lf.fd)
                    lf.fd = -1
                if not lf.dirty:
                    self._offer(lf)
        self.changed.set()

    def _offer(self, lf: LocalFile) -> None:
        """A clean file nobody has open is cached data: the cache may drop it for room."""

        def free() -> int:
            if (lf.removed or lf.dirty or lf.opens or lf.lock.locked()
                    or lf.fid in self._charging or self.by_key.get(lf.key) is not lf):
                return 0  # in use again: offered anew when it is clean and closed
            freed = lf.charged
            self.remove(lf)
            return freed

        self.space.offer(lf, free)

    def dirty_files(self) -> Iterator[LocalFile]:
        return (lf for lf in self.by_key.values() if lf.dirty)

    def dirty_summary(self) -> tuple[int, int, float | None]:
        """(dirty files, their bytes, seconds since the oldest change not in S3). Safe to
        call from the metrics thread: it works on a snapshot of the table."""
        dirty = [lf for lf in list(self.by_key.values()) if lf.dirty]
        now = time.time()
        oldest = min((lf.dirty_since or now for lf in dirty), default=None)
        return len(dirty), sum(lf.size for lf in dirty), \
            None if oldest is None else round(now - oldest, 1)

    def close(self) -> None:
        for lf in self.by_key.values():
            if lf.fd >= 0:
                os.close(lf.fd)
                lf.fd = -1
