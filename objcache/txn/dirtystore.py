"""Sealed dirty blobs: the closed, not yet uploaded versions of files, by content id.

When a file is closed on a node, its content becomes an immutable blob `<cid>` in
CACHE_DIR/dirty (a hard link to the working copy, so sealing copies nothing; the working
copy is unshared before it is written again), and the other holders pull a copy from us
before the close returns: that is the replication that makes a closed file outlive its
node. Blobs are named by content id, not by path, so a rename moves no data. A blob goes
when no namespace entry refers to it any more (after upload, overwrite or unlink).

Replication while writing: a writer exposes its working copy under a stage id (`expose`),
and the replicas pull its complete pieces into `<sid>.stage` files as it grows (`stage`).
The pull at close then adopts the staged prefix and fetches only the rest. A stage nobody
adopts is dropped after STAGE_IDLE seconds without growth.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from objcache.errors import NoSpace, NotFound, first_error

log = logging.getLogger(__name__)

PIECE = 8 << 20  # bytes per pull request
PULL_PARALLEL = 4
KEEP_UNREFERENCED = 120.0  # seconds a blob may wait for the commit that refers to it
STAGE_IDLE = 600.0  # seconds a stage may go without growing before it is dropped

# (offset, buffer): fill the buffer with the blob's bytes from `offset`, read from a holder
Reader = Callable[[int, memoryview], Awaitable[None]]


FICLONE = 0x40049409  # _IOW(0x94, 9, int)


def _copy(src: str, dst: str, size: int) -> None:
    with open(src, "rb") as f, open(dst, "wb") as g:
        try:
            fcntl.ioctl(g.fileno(), FICLONE, f.fileno())
            return
        except OSError:
            pass  # (no reflinks here, ext4 for one)
        off = 0
        while off < size:
            n = os.copy_file_range(f.fileno(), g.fileno(), size - off)
            if n == 0:
                raise OSError(errno.EIO, f"{src} is shorter than {size} bytes")
            off += n


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except FileNotFoundError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


READ_TRIES = 3


def _read_blob_file(path: str, offset: int, length: int) -> bytes:
    """pread of a blob's file, read again if the name came to show another file meanwhile.
    A blob sealed as a hard link to a working copy is detached before that copy is
    written again (`detach`: a copy renamed over the blob's name, then the working copy
    is truncated and rewritten): a read that opened the name before the rename and read
    after the truncate got the working copy's new bytes, or none (a peer's read of a
    register then returned an empty file; the partition nemesis, 5 nodes)."""
    for _ in range(READ_TRIES):
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, offset)
            st = os.fstat(f.fileno())
        try:
            now = os.stat(path)
        except FileNotFoundError:
            break
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            return data
    raise NotFound(f"blob file {path} was replaced or removed while read")


@dataclass(slots=True)
class Stage:
    end: int = 0  # bytes [0, end) are in the stage file
    touched: float = 0.0
    lock: trio.Lock = field(default_factory=trio.Lock)


PAGE = 4096


def _open_for_pieces(path: str, direct: bool) -> int:
    if direct:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a file system without O_DIRECT (tmpfs)
                raise
    return os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)


def _write_piece(fd: int, buf: mmap.mmap, n: int, off: int) -> None:
    """`n` bytes of `buf` at `off` (a multiple of PAGE), rounded up to whole pages so an
    O_DIRECT descriptor takes them; the caller cuts the file to size afterwards."""
    view = memoryview(buf)[:-(-n // PAGE) * PAGE]
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], off + done)


class DirtyStore:
    def __init__(self, root: Path, charge: Callable[[int], bool],
                 release: Callable[[int], None]) -> None:
        self.root = root / "dirty"
        self.root.mkdir(parents=True, exist_ok=True)
        self._charge = charge
        self._release = release
        self.sizes: dict[str, int] = {}
        self.born: dict[str, float] = {}  # cid -> when it appeared (unreferenced grace)
        self.committed: set[str] = set()  # seen referenced by an entry: no grace once not
        self.io = trio.CapacityLimiter(8)  # file copies and fsyncs off the trio thread
        self.exposed: dict[str, str] = {}  # writer side: stage id -> working copy path
        self.stages: dict[str, Stage] = {}  # replica side: stage id -> what is staged
        self.staged_bytes = 0  # pulled while their file was being written
        for f in self.root.iterdir():
            if f.name.endswith((".part", ".stage", ".detach")):
                f.unlink()
                continue
            size = f.stat().st_size
            self.sizes[f.name] = size
            self.born[f.name] = time.monotonic()
            charge(size)
        if self.sizes:
            log.info("found %d dirty blobs (%d bytes) in the cache dir", len(self.sizes),
                     sum(self.sizes.values()))

    def path(self, cid: str) -> str:
        if "/" in cid or cid.startswith("."):
            raise ValueError(f"bad content id {cid!r}")
        return str(self.root / cid)

    def has(self, cid: str) -> bool:
        return cid in self.sizes

    def seal(self, cid: str, working_copy: str, size: int) -> None:
        """Make the working copy's current content blob `cid` (a hard link: no copy; the
        working copy is not written again before `detach`, or a copy of its own)."""
        os.link(working_copy, self.path(cid))
        self._add(cid, size)

    async def detach(self, cid: str, working_copy: str,
                     check: Callable[[str], Awaitable[bool]]) -> None:
        """Blob `cid` was sealed as a hard link to a working copy the kernel writes
        without us (`seal`): give it a file of its own before that working copy is
        written again. The copy is kept if `check(path)` finds the committed bytes in it;
        if not (a shared mapping or an inherited descriptor wrote the file after its
        close), this node holds the blob no more and its readers go to the other
        holders."""
        path = self.path(cid)
        if cid not in self.sizes or not _same_file(path, working_copy):
            return  # dropped meanwhile (written back), or detached already
        tmp = path + ".detach"
        try:
            await trio.to_thread.run_sync(_copy, working_copy, tmp, self.sizes[cid],
                                          limiter=self.io)
            ok = await check(tmp)
            if cid in self.sizes and ok:
                os.rename(tmp, path)
                return
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if cid in self.sizes:
            log.warning("blob %s was written after its close (through a shared mapping or "
                        "an inherited descriptor): this node no longer holds it", cid)
            self.drop(cid)

    async def seal_copy(self, cid: str, working_copy: str, size: int) -> None:
        """Make a copy of the working copy's current content blob `cid` (for a file the
        kernel writes without us, passthrough: a hard link would let its later writes
        change the blob). A reflink where the file system has them, else an in-kernel
        copy, in a worker thread."""
        dst = self.path(cid)
        await trio.to_thread.run_sync(_copy, working_copy, dst, size)
        try:
            self._add(cid, size)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst)
            raise

    def _add(self, cid: str, size: int) -> None:
        if not self._charge(size):
            os.unlink(self.path(cid))
            raise NoSpace(f"no room for a {size}-byte dirty copy in the cache")
        self.sizes[cid] = size
        self.born[cid] = time.monotonic()

    async def read(self, cid: str, offset: int, length: int) -> bytes:
        """Bytes of blob `cid`, or of the working copy exposed as stage `cid`."""
        path = self.exposed.get(cid)
        if path is None:
            if cid not in self.sizes:
                raise NotFound(f"blob {cid} is not held here")
            path = self.path(cid)

        return await trio.to_thread.run_sync(_read_blob_file, path, offset, length,
                                             limiter=self.io)

    # -- replication while writing ----------------------------------------------------------

    def expose(self, sid: str, working_copy: str) -> None:
        self.path(sid)  # a valid name
        self.exposed[sid] = working_copy

    def unexpose(self, sid: str) -> None:
        self.exposed.pop(sid, None)

    async def stage(self, sid: str, end: int, reader: Reader) -> None:
        """Pull the staged file of `sid` up to `end` bytes from its writer (`reader`)."""
        st = self.stages.setdefault(sid, Stage(touched=time.monotonic()))
        async with st.lock:
            if end <= st.end:
                return
            grow = end - st.end
            if not self._charge(grow):
                raise NoSpace(f"no room to stage {grow} bytes of a file being written")
            try:
                # synced as it goes: the close's pull then only has the tail to sync
                await self._fetch(self.path(sid) + ".stage", st.end, end, reader, sync=True)
            except BaseException:
                self._release(grow)
                raise
            st.end = end
            st.touched = time.monotonic()
            self.staged_bytes += grow

    def _adopt(self, sid: str, upto: int, part: str) -> int:
        """Make the first `upto` staged bytes of `sid` the start of `part` (0: drop the
        stage); how many."""
        st = self.stages.get(sid)
        if st is None or st.lock.locked():  # a pull still running: stale, GC drops it
            return 0
        del self.stages[sid]
        self._release(st.end)
        upto = min(upto, st.end)
        if upto:
            os.rename(self.path(sid) + ".stage", part)
        else:  # the file changed behind the stage
            os.unlink(self.path(sid) + ".stage")
        return upto

    def _drop_stale_stages(self) -> None:
        now = time.monotonic()
        for sid, st in list(self.stages.items()):
            if now - st.touched > STAGE_IDLE and not st.lock.locked():
                del self.stages[sid]
                self._release(st.end)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(sid) + ".stage")

    async def _fetch(self, path: str, start: int, end: int, reader: Reader,
                     sync: bool) -> None:
        """Bytes [start, end) of the file at `path`, from `reader`; the file ends at `end`.
        Written with O_DIRECT where the file system takes it (a replica's copy is not read
        again soon, and on the cache disk direct writes are about 3x faster than buffered
        ones once the page cache has to write back)."""
        fd = _open_for_pieces(path, direct=start % PAGE == 0)
        # PULL_PARALLEL page-aligned buffers, reused piece after piece: the bytes are
        # received into them and written from them (no allocation, no copies)
        size = -(-min(PIECE, end - start) // PAGE) * PAGE
        free = [mmap.mmap(-1, size) for _ in range(PULL_PARALLEL if size else 0)]
        try:
            limiter = trio.CapacityLimiter(PULL_PARALLEL)

            async def piece(off: int) -> None:
                async with limiter:
                    buf = free.pop()
                    try:
                        n = min(PIECE, end - off)
                        await reader(off, memoryview(buf)[:n])
                        await trio.to_thread.run_sync(_write_piece, fd, buf, n, off,
                                                      limiter=self.io)
                    finally:
                        free.append(buf)

            with first_error():  # the holder's error itself, for the caller to catch
                async with trio.open_nursery() as nursery:
                    for off in range(start, end, PIECE):
                        nursery.start_soon(piece, off)
            os.ftruncate(fd, end)  # a direct write of the tail rounds it up to a page
            if sync:
                await trio.to_thread.run_sync(os.fdatasync, fd, limiter=self.io)
        finally:
            os.close(fd)
            for buf in free:
                # After a failed piece, the exception on its way up (its traceback's
                # frames) may still hold views of a buffer: that one goes with them.
                with contextlib.suppress(BufferError):
                    buf.close()

    # -- pulling a whole blob -----------------------------------------------------------

    async def pull(self, cid: str, size: int, reader: Reader, stage: str | None = None,
                   staged: int = 0) -> None:
        """Copy blob `cid` from a holder (`reader`), durably, unless we hold it already;
        the first `staged` bytes may already be here as stage `stage`."""
        if cid in self.sizes:
            return
        part = self.path(cid) + f".{os.getpid()}.{id(reader)}.part"
        have = self._adopt(stage, min(staged, size), part) if stage else 0
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | (0 if have else os.O_TRUNC), 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            await self._fetch(part, have, size, reader, sync=True)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise
        if cid in self.sizes:  # pulled twice at once
            os.unlink(part)
            return
        os.rename(part, self.path(cid))
        self._add(cid, size)

    def drop(self, cid: str) -> None:
        size = self.sizes.pop(cid, None)
        self.born.pop(cid, None)
        self.committed.discard(cid)
        if size is None:
            return
        try:
            os.unlink(self.path(cid))
        except FileNotFoundError:
            pass
        self._release(size)

    def committed_here(self, cid: str) -> None:
        """This node's commit that refers to blob `cid` succeeded: once no entry refers to
        it (written back), `gc` drops it without the grace for a commit still on its way.
        Without this the writer learnt it only from a gc pass that saw the entry, and an
        upload that cleaned the entry before the next pass left the blob (and the writer
        waiting for its room) for KEEP_UNREFERENCED."""
        if cid in self.sizes:
            self.committed.add(cid)

    def gc(self, referenced: set[str]) -> int:
        """Drop blobs nothing refers to (after a grace period for ones being committed)."""
        self._drop_stale_stages()
        now = time.monotonic()
        n = 0
        self.committed |= referenced & self.sizes.keys()
        for cid in list(self.sizes):
            if cid not in referenced and (cid in self.committed or
                                          now - self.born.get(cid, 0) > KEEP_UNREFERENCED):
                self.drop(cid)
                n += 1
        return n
