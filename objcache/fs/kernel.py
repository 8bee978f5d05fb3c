"""The FUSE session: objcache's own speaker of the kernel's protocol on /dev/fuse.

It owns one mount's /dev/fuse descriptor. It negotiates INIT (1 MiB requests,
readdirplus, parallel directory operations, passthrough where the kernel offers it),
reads requests in the trio event loop, decodes each into a call on an `Operations`
object, runs that call in a task of its own, and writes the reply. It also sends the
kernel's notifications (invalidations, deletions) and registers passthrough backing
files. It knows /dev/fuse and nothing else: no S3, no filesystem core
(objcache.fs.operations adapts the core to it).

Why our own and not libfuse: the open reply of a passthrough file carries a backing id,
and INIT must ask for FUSE_PASSTHROUGH; libfuse 3.14 (what Debian 12 ships) and pyfuse3
can do neither (../shared/reference/fuse-passthrough.md). go-fuse (JuiceFS) and fuser
(mountpoint-s3) speak the protocol themselves for the same reasons.

Rules the kernel sets, and how they are kept here:
- A request's reply is one write(2) of header + payload; a write that fails with ENOENT
  answers a request the kernel gave up on (the caller was killed): nothing to do.
- FORGET and BATCH_FORGET get no reply; INTERRUPT names a request we already read (the
  kernel interrupts only requests it has sent): read-only requests are cancelled and
  answered EINTR, the others finish (their effect must not be half-made).
- Notifications are written from a worker thread: an entry invalidation takes the
  directory's lock in the kernel, which a request we are serving may hold.
- An exception an operation does not turn into a FuseError is a bug: it is logged and
  the request answered EIO; the session goes on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from objcache.fs import abi
from objcache.fs.mounting import MountOptions, mount, set_read_ahead, unmount

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20  # the largest request (max_pages 256 on this kernel's default limit)
MAX_PAGES = MAX_WRITE // 4096
BUFFER_SIZE = MAX_WRITE + 4096  # a WRITE's data plus its headers
READS_PER_YIELD = 16  # requests read in a row before the handlers get to run
KEPT_BUFFERS = 8  # request buffers kept for reuse (a WRITE holds one until it is done)
NS = 1_000_000_000

# Only these are cancelled by an INTERRUPT: they change nothing, so a half-run one leaves
# no trace. The others run to the end and reply.
_INTERRUPTIBLE = frozenset({abi.LOOKUP, abi.GETATTR, abi.READLINK, abi.READ, abi.STATFS,
                            abi.GETXATTR, abi.LISTXATTR, abi.ACCESS, abi.READDIR,
                            abi.READDIRPLUS})


class FuseError(Exception):
    """An operation's answer is this errno."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.errno = code


class AttrLike(Protocol):
    """The attributes an operation replies (objcache.core.inode.Attr is one)."""

    ino: int
    mode: int
    size: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int
    ctime_ns: int
    nlink: int
    rdev: int
    cache_timeout: float


@dataclass(slots=True)
class Ctx:
    """Who made a request."""

    uid: int
    gid: int
    pid: int


@dataclass(slots=True)
class SetAttr:
    """A SETATTR's changes; None: unchanged."""

    size: int | None = None
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


@dataclass(slots=True)
class Opened:
    """An OPEN, CREATE or OPENDIR answer. `backing_id`: a registered passthrough backing
    file (see FuseSession.backing_open); the kernel then serves READ, WRITE and mmap from
    it without us."""

    fh: int
    keep_cache: bool = False
    direct_io: bool = False
    nonseekable: bool = False
    cache_dir: bool = False
    backing_id: int = 0
    noflush: bool = False  # nothing to do at close(2): the kernel sends no FLUSH

    def flags(self) -> int:
        f = 0
        if self.backing_id:
            f |= abi.FOPEN_PASSTHROUGH  # (never with KEEP_CACHE: the kernel refuses it)
        elif self.keep_cache:
            f |= abi.FOPEN_KEEP_CACHE
        if self.direct_io:
            f |= abi.FOPEN_DIRECT_IO
        if self.nonseekable:
            f |= abi.FOPEN_NONSEEKABLE
        if self.cache_dir:
            f |= abi.FOPEN_CACHE_DIR
        if self.noflush:
            f |= abi.FOPEN_NOFLUSH
        return f


@dataclass(slots=True)
class StatFs:
    bsize: int
    blocks: int
    bfree: int
    files: int
    ffree: int
    namemax: int


def _split(t: float) -> tuple[int, int]:
    s = int(t)
    return s, int((t - s) * NS)


def _attr_fields(a: AttrLike, blksize: int) -> tuple[int, ...]:
    m = a.mtime_ns
    at = a.atime_ns or m
    ct = a.ctime_ns or m
    return (a.ino, a.size, (a.size + 511) // 512, at // NS, m // NS, ct // NS, at % NS,
            m % NS, ct % NS, a.mode, a.nlink, a.uid, a.gid, a.rdev, blksize, 0)


class DirBuffer:
    """One READDIR(PLUS) reply being filled: entries go in while they fit."""

    __slots__ = ("buf", "size", "plus", "blksize")

    def __init__(self, size: int, plus: bool, blksize: int) -> None:
        self.buf = bytearray()
        self.size = size
        self.plus = plus
        self.blksize = blksize

    def add(self, name: bytes, ino: int, mode: int, a: AttrLike | None,
            next_offset: int) -> bool:
        """Add an entry (`next_offset`: where a READDIR after it resumes); False if it
        does not fit. With readdirplus the kernel counts a lookup for each entry added
        with attributes; without (`a` None) it lists the name and caches nothing."""
        n = len(name)
        pad = -(abi.DIRENT.size + n) % 8
        need = abi.DIRENT.size + n + pad + (abi.ENTRY_OUT.size if self.plus else 0)
        if len(self.buf) + need > self.size:
            return False
        if self.plus:
            if a is None:
                self.buf += bytes(abi.ENTRY_OUT.size)  # nodeid 0: no attributes
            else:
                t = _split(a.cache_timeout)
                self.buf += abi.ENTRY_OUT.pack(a.ino, 0, t[0], t[0], t[1], t[1],
                                               *_attr_fields(a, self.blksize))
        self.buf += abi.DIRENT.pack(ino, next_offset, n, (mode >> 12) & 0o17)
        self.buf += name
        self.buf += bytes(pad)
        return True


class Operations(Protocol):
    """What the session calls; objcache.fs.operations.Operations implements it. Errors
    are raised as FuseError."""

    def initialized(self, session: FuseSession) -> None: ...

    def forget(self, items: Sequence[tuple[int, int]]) -> None: ...

    def lookup_now(self, parent: int, name: bytes) -> AttrLike | None: ...

    async def lookup(self, parent: int, name: bytes, ctx: Ctx) -> AttrLike: ...

    def getattr_now(self, ino: int, fh: int | None) -> AttrLike | None: ...

    async def getattr(self, ino: int, fh: int | None, ctx: Ctx) -> AttrLike: ...

    async def setattr(self, ino: int, changes: SetAttr, fh: int | None,
                      ctx: Ctx) -> AttrLike: ...

    async def readlink(self, ino: int, ctx: Ctx) -> bytes: ...

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int,
                    ctx: Ctx) -> AttrLike: ...

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> AttrLike: ...

    async def unlink(self, parent: int, name: bytes, ctx: Ctx) -> None: ...

    async def rmdir(self, parent: int, name: bytes, ctx: Ctx) -> None: ...

    async def symlink(self, parent: int, name: bytes, target: bytes,
                      ctx: Ctx) -> AttrLike: ...

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
                     flags: int, ctx: Ctx) -> None: ...

    async def link(self, ino: int, new_parent: int, new_name: bytes,
                   ctx: Ctx) -> AttrLike: ...

    def open_now(self, ino: int, flags: int, ctx: Ctx) -> Opened | None: ...

    async def open(self, ino: int, flags: int, ctx: Ctx) -> Opened: ...

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[Opened, AttrLike]: ...

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        ...

    async def write(self, fh: int, offset: int, data: memoryview) -> int: ...

    async def flush(self, fh: int) -> None: ...

    def release_now(self, fh: int) -> bool: ...

    async def release(self, fh: int) -> None: ...

    async def fsync(self, fh: int, datasync: bool) -> None: ...

    async def opendir(self, ino: int, ctx: Ctx) -> Opened: ...

    async def readdir(self, fh: int, offset: int, out: DirBuffer) -> None: ...

    async def releasedir(self, fh: int) -> None: ...

    async def statfs(self, ctx: Ctx) -> StatFs: ...

    async def getxattr(self, ino: int, name: bytes, ctx: Ctx) -> bytes: ...

    async def listxattr(self, ino: int, ctx: Ctx) -> list[bytes]: ...

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int,
                       ctx: Ctx) -> None: ...

    async def removexattr(self, ino: int, name: bytes, ctx: Ctx) -> None: ...


Encoder = Callable[[Any], "bytes | bytearray | memoryview | None"]
_ANSWERED = object()  # a fast path failed, and its error was answered


def _cstr(body: memoryview, start: int = 0) -> tuple[bytes, int]:
    """The NUL-terminated string at `start`, and where the next one starts."""
    raw = bytes(body[start:])
    end = raw.index(b"\0")
    return raw[:end], start + end + 1


class FuseSession:
    """One mount's FUSE connection. Made unmounted (the notifier and the core are given
    it at construction); `mount` makes the mount, `serve` answers requests until the
    file system is unmounted or `terminate` is called, `close` lets go of everything.

    Attributes, once INIT is answered:
    proto_minor: the protocol minor in use.
    passthrough: the kernel agreed to passthrough and we may register backing files
        (CAP_SYS_ADMIN in the initial user namespace); why not in `passthrough_off`.
    """

    def __init__(self, mountpoint: str, options: MountOptions, *,
                 passthrough: bool = True, blksize: int = 1 << 20,
                 read_ahead_kb: int = 1024) -> None:
        self.mountpoint = mountpoint
        self.options = options
        self.read_ahead_kb = read_ahead_kb
        self.want_passthrough = passthrough
        self.blksize = blksize
        self.fd = -1
        self.proto_minor = 0
        self.initialized = False
        self.passthrough = False
        self.passthrough_off = "--no-passthrough" if not passthrough else "not negotiated"
        self.requests = 0
        self.by_opcode = [0] * 64  # requests read, by opcode
        self._ops: Operations | None = None
        self._nursery: trio.Nursery | None = None
        self._cancel: trio.CancelScope | None = None
        self._inflight: dict[int, trio.CancelScope] = {}
        self._buffers: list[bytearray] = []
        self._notify_limiter = trio.CapacityLimiter(1)
        self._dispatch: dict[int, Callable[[int, int, Ctx, memoryview], None]] = {
            abi.LOOKUP: self._lookup, abi.GETATTR: self._getattr,
            abi.SETATTR: self._setattr, abi.READLINK: self._readlink,
            abi.SYMLINK: self._symlink, abi.MKNOD: self._mknod, abi.MKDIR: self._mkdir,
            abi.UNLINK: self._unlink, abi.RMDIR: self._rmdir, abi.RENAME: self._rename,
            abi.RENAME2: self._rename2, abi.LINK: self._link, abi.OPEN: self._open,
            abi.READ: self._read, abi.WRITE: self._write, abi.STATFS: self._statfs,
            abi.RELEASE: self._release, abi.FSYNC: self._fsync,
            abi.SETXATTR: self._setxattr, abi.GETXATTR: self._getxattr,
            abi.LISTXATTR: self._listxattr, abi.REMOVEXATTR: self._removexattr,
            abi.FLUSH: self._flush, abi.OPENDIR: self._opendir,
            abi.READDIR: self._readdir, abi.READDIRPLUS: self._readdirplus,
            abi.RELEASEDIR: self._releasedir, abi.FSYNCDIR: self._fsyncdir,
            abi.ACCESS: self._access, abi.CREATE: self._create,
        }

    # -- life ---------------------------------------------------------------------------

    def mount(self) -> None:
        self.fd = mount(self.mountpoint, self.options)
        os.set_blocking(self.fd, False)

    async def serve(self, ops: Operations) -> None:
        """Answer requests until the file system is unmounted (or `terminate`)."""
        self._ops = ops
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._read_loop(nursery)
                nursery.cancel_scope.cancel()
        self._nursery = None

    def terminate(self) -> None:
        """Stop answering (what is in flight is cancelled); the mount stays until
        `close`."""
        if self._cancel is not None:
            self._cancel.cancel()

    def close(self, unmount_it: bool = True) -> None:
        if unmount_it and self.fd >= 0:
            unmount(self.mountpoint)
        if self.fd >= 0:
            os.close(self.fd)  # aborts whatever still waits for an answer
            self.fd = -1
        self.initialized = False

    # -- reading ------------------------------------------------------------------------

    def _take_buffer(self) -> bytearray:
        return self._buffers.pop() if self._buffers else bytearray(BUFFER_SIZE)

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        fd = self.fd
        buf = self._take_buffer()
        view = memoryview(buf)
        in_a_row = 0
        while True:
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                in_a_row = 0
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):
                    continue  # the request was interrupted before we read it
                if e.errno == errno.ENODEV:
                    return  # unmounted
                raise
            length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = \
                abi.IN_HEADER.unpack_from(buf)
            if n != length:
                log.error("short FUSE request (%d of %d bytes); ignored", n, length)
                continue
            self.requests += 1
            self.by_opcode[opcode & 63] += 1
            body = view[abi.IN_HEADER.size:length - extlen * 8]
            try:
                if opcode == abi.WRITE:
                    # The data stays in this buffer until the write is done: read the
                    # next request into another one.
                    self._write(unique, nodeid, Ctx(uid, gid, pid), body, buf)
                    view.release()
                    buf = self._take_buffer()
                    view = memoryview(buf)
                else:
                    self._decode(opcode, unique, nodeid, uid, gid, pid, body)
            except Exception:
                log.exception("could not decode FUSE request %d (opcode %d)", unique,
                              opcode)
                self._reply_error(unique, errno.EIO)
            in_a_row += 1
            if in_a_row >= READS_PER_YIELD:
                in_a_row = 0
                await trio.lowlevel.checkpoint()

    def _decode(self, opcode: int, unique: int, nodeid: int, uid: int, gid: int, pid: int,
                body: memoryview) -> None:
        handler = self._dispatch.get(opcode)
        if handler is not None:
            handler(unique, nodeid, Ctx(uid, gid, pid), body)
        elif opcode == abi.FORGET:
            self._forget([(nodeid, abi.FORGET_IN.unpack_from(body)[0])])
        elif opcode == abi.BATCH_FORGET:
            count = abi.BATCH_FORGET_IN.unpack_from(body)[0]
            off = abi.BATCH_FORGET_IN.size
            self._forget([abi.FORGET_ONE.unpack_from(body, off + i * abi.FORGET_ONE.size)
                          for i in range(count)])
        elif opcode == abi.INTERRUPT:
            scope = self._inflight.get(abi.INTERRUPT_IN.unpack_from(body)[0])
            if scope is not None:
                scope.cancel()
        elif opcode == abi.INIT:
            self._init(unique, body)
        elif opcode == abi.DESTROY:
            self._reply(unique, None)
        elif opcode == abi.IOCTL:
            # No ioctls here (CPython's open() asks isatty of every file: answered at
            # once, without a task; the kernel asks again on every call whatever we say).
            self._reply_error(unique, errno.ENOTTY)
        else:
            # LSEEK, FALLOCATE, COPY_FILE_RANGE, STATX, locks, poll, ...: the kernel falls
            # back to its generic code (or says EOPNOTSUPP) and stops asking.
            self._reply_error(unique, errno.ENOSYS)

    def _forget(self, items: Sequence[tuple[int, int]]) -> None:
        assert self._ops is not None
        try:
            self._ops.forget(items)
        except Exception:
            log.exception("forget failed")

    # -- INIT ---------------------------------------------------------------------------

    def _init(self, unique: int, body: memoryview) -> None:
        major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(body)[:4]
        if major > abi.KERNEL_MAJOR:
            # The kernel retries with our major version.
            self._reply(unique, abi.INIT_OUT.pack(abi.KERNEL_MAJOR, abi.KERNEL_MINOR,
                                                  *([0] * 11)))
            return
        if major < abi.KERNEL_MAJOR or minor < abi.MIN_MINOR:
            log.error("the kernel speaks FUSE %d.%d; objcache needs %d.%d or newer", major,
                      minor, abi.KERNEL_MAJOR, abi.MIN_MINOR)
            self._reply_error(unique, errno.EPROTO)
            return
        flags2 = abi.INIT_IN.unpack_from(body)[4] if flags & abi.INIT_EXT else 0
        offered = flags | flags2 << 32
        want = (abi.ASYNC_READ | abi.ATOMIC_O_TRUNC | abi.BIG_WRITES | abi.AUTO_INVAL_DATA
                | abi.DO_READDIRPLUS | abi.ASYNC_DIO | abi.PARALLEL_DIROPS
                | abi.HANDLE_KILLPRIV | abi.MAX_PAGES | abi.INIT_EXT)
        if self.want_passthrough:
            if offered & abi.PASSTHROUGH:
                want |= abi.PASSTHROUGH
            else:
                self.passthrough_off = (f"the kernel (FUSE 7.{minor}) does not offer it "
                                        "(Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)")
        want &= offered
        self.proto_minor = min(minor, abi.KERNEL_MINOR)
        self._reply(unique, abi.INIT_OUT.pack(
            abi.KERNEL_MAJOR, self.proto_minor, max_readahead, want & 0xFFFF_FFFF,
            0, 0,  # max_background, congestion_threshold: the kernel's defaults
            MAX_WRITE, 1, MAX_PAGES, 0, want >> 32,
            1 if want & abi.PASSTHROUGH else 0, 0))
        self.initialized = True
        # The kernel set the mount's readahead while taking that reply (to at most its
        # default, 128 KiB): raise it now, so reads come in 1 MiB requests.
        set_read_ahead(self.mountpoint, self.read_ahead_kb)
        if want & abi.PASSTHROUGH:
            self._probe_passthrough()
        log.info("FUSE session: protocol 7.%d, %d KiB requests, passthrough %s",
                 self.proto_minor, MAX_WRITE >> 10,
                 "on" if self.passthrough else f"off ({self.passthrough_off})")
        assert self._ops is not None
        self._ops.initialized(self)

    def _probe_passthrough(self) -> None:
        """Register a throwaway backing file once: the kernel refuses it (EPERM) to a
        daemon without CAP_SYS_ADMIN in the initial user namespace."""
        probe = os.memfd_create("objcache-passthrough-probe", os.MFD_CLOEXEC)
        try:
            self.backing_close(self.backing_open(probe))
            self.passthrough = True
        except OSError as e:
            self.passthrough_off = (
                "the kernel refused a backing file (CAP_SYS_ADMIN in the initial user "
                f"namespace is needed): {e.strerror}")
        finally:
            os.close(probe)

    def counts(self) -> dict[str, int]:
        """Requests read so far, by operation."""
        return {abi.OPCODE_NAMES.get(op, str(op)): n for op, n in enumerate(self.by_opcode)
                if n}

    # -- passthrough --------------------------------------------------------------------

    def backing_open(self, fd: int) -> int:
        """Register the open file `fd` as a backing file; its id for an open reply.
        The kernel holds its own reference: `fd` may be closed after."""
        arg = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        return fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, arg, True)

    def backing_close(self, backing_id: int) -> None:
        """Forget a backing id (files opened with it keep their backing file)."""
        arg = bytearray(backing_id.to_bytes(4, "little"))
        fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, arg, True)

    # -- notifications ------------------------------------------------------------------

    async def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Make the kernel forget the name `name` in directory `parent`."""
        await self._notify(abi.NOTIFY_INVAL_ENTRY, abi.NOTIFY_INVAL_ENTRY_OUT.pack(
            parent, len(name), 0) + name + b"\0")

    async def notify_delete(self, parent: int, child: int, name: bytes) -> None:
        """`name` in `parent` (inode `child`) was deleted: drop the name and mark the
        kernel's inode deleted. If the kernel knows the name as another inode (ENOENT),
        the name is dropped all the same."""
        if not await self._notify(abi.NOTIFY_DELETE, abi.NOTIFY_DELETE_OUT.pack(
                parent, child, len(name), 0) + name + b"\0"):
            await self.invalidate_entry(parent, name)

    async def invalidate_inode(self, ino: int, attrs_only: bool = False) -> None:
        """Drop the kernel's attributes of `ino` and (unless `attrs_only`) its cached
        pages (for a directory: its cached listing)."""
        await self._notify(abi.NOTIFY_INVAL_INODE, abi.NOTIFY_INVAL_INODE_OUT.pack(
            ino, -1 if attrs_only else 0, 0))

    def invalidate_attrs_now(self, ino: int) -> None:
        """Drop the kernel's attributes of `ino` at once. Safe inside a request: an
        attribute-only invalidation takes no inode lock."""
        self._notify_now(abi.NOTIFY_INVAL_INODE, abi.NOTIFY_INVAL_INODE_OUT.pack(ino, -1, 0))

    async def _notify(self, code: int, payload: bytes) -> bool:
        """Send a notification (from a worker thread); False if the kernel did not know
        what it names (ENOENT: nothing of it was cached)."""
        if not self.initialized:
            return True  # nothing cached in a kernel that has not started yet
        try:
            return await trio.to_thread.run_sync(self._notify_now, code, payload,
                                                 limiter=self._notify_limiter)
        except Exception:  # (a system task: an exception would end the daemon)
            log.exception("FUSE notification %d failed", code)
            return True

    def _notify_now(self, code: int, payload: bytes) -> bool:
        if not self.initialized or self.fd < 0:
            return True
        try:
            os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), code,
                                                  0) + payload)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            if e.errno not in (errno.ENOTDIR, errno.EBADF, errno.ENODEV, errno.ENOTEMPTY,
                               errno.EBUSY):
                log.info("FUSE notification %d failed: %s", code, e)
        return True

    # -- replies ------------------------------------------------------------------------

    def _reply(self, unique: int, payload: bytes | bytearray | memoryview | None) -> None:
        try:
            if payload is None:
                os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, 0, unique))
            elif len(payload) < 4096:
                os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), 0,
                                                      unique) + payload)
            else:
                os.writev(self.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload),
                                                        0, unique), payload])
        except OSError as e:
            self._write_failed(unique, e)

    def _reply_error(self, unique: int, code: int) -> None:
        try:
            os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -code, unique))
        except OSError as e:
            self._write_failed(unique, e)

    def _write_failed(self, unique: int, e: OSError) -> None:
        if e.errno in (errno.ENOENT, errno.ENODEV, errno.EBADF):
            return  # the kernel gave up on the request (its caller was killed), or unmounted
        log.error("could not answer FUSE request %d: %s", unique, e)

    def _spawn(self, unique: int, opcode: int, encode: Encoder,
               fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run, unique, opcode, encode, fn, args)

    async def _run(self, unique: int, opcode: int, encode: Encoder,
                   fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                   buf: bytearray | None = None) -> None:
        interruptible = opcode in _INTERRUPTIBLE
        try:
            with trio.CancelScope() as scope:
                if interruptible:
                    self._inflight[unique] = scope
                result = await fn(*args)
                payload = encode(result)
            if scope.cancelled_caught:
                self._reply_error(unique, errno.EINTR)
            else:
                self._reply(unique, payload)
        except FuseError as e:
            self._reply_error(unique, e.errno)
        except Exception:
            log.exception("unexpected error in FUSE request %d (opcode %d); replying EIO",
                          unique, opcode)
            self._reply_error(unique, errno.EIO)
        finally:
            if interruptible:
                self._inflight.pop(unique, None)
            if buf is not None and len(self._buffers) < KEPT_BUFFERS:
                self._buffers.append(buf)  # (beyond a few, a burst's buffers go)

    # -- encoders -----------------------------------------------------------------------

    def _entry(self, a: AttrLike) -> bytes:
        t = _split(a.cache_timeout)
        return abi.ENTRY_OUT.pack(a.ino, 0, t[0], t[0], t[1], t[1],
                               *_attr_fields(a, self.blksize))

    def _attr(self, a: AttrLike) -> bytes:
        t = _split(a.cache_timeout)
        return abi.ATTR_OUT.pack(t[0], t[1], 0, *_attr_fields(a, self.blksize))

    @staticmethod
    def _none(_: object) -> None:
        return None

    @staticmethod
    def _same(data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        return data

    @staticmethod
    def _opened(o: Opened) -> bytes:
        return abi.OPEN_OUT.pack(o.fh, o.flags(), o.backing_id)

    def _created(self, r: tuple[Opened, AttrLike]) -> bytes:
        return self._entry(r[1]) + self._opened(r[0])

    # -- requests -----------------------------------------------------------------------

    def _lookup(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        name, _ = _cstr(body)
        a = self._now(unique, self._ops.lookup_now, nodeid, name)
        if a is _ANSWERED:
            return
        if a is not None:
            self._reply(unique, self._entry(a))
            return
        self._spawn(unique, abi.LOOKUP, self._entry, self._ops.lookup, nodeid, name, ctx)

    def _now(self, unique: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an operation's synchronous fast path: its result (None: it needs the task
        path), or _ANSWERED if it failed and its error was answered."""
        try:
            return fn(*args)
        except FuseError as e:
            self._reply_error(unique, e.errno)
        except Exception:
            log.exception("unexpected error in FUSE request %d; replying EIO", unique)
            self._reply_error(unique, errno.EIO)
        return _ANSWERED

    def _getattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        flags, _, fh = abi.GETATTR_IN.unpack_from(body)
        fh_or_none = fh if flags & abi.GETATTR_FH else None
        # Known attributes are answered at once, without a task (an open() makes the
        # kernel ask for them again after every read: it invalidates atime).
        a = self._now(unique, self._ops.getattr_now, nodeid, fh_or_none)
        if a is _ANSWERED:
            return
        if a is not None:
            self._reply(unique, self._attr(a))
            return
        self._spawn(unique, abi.GETATTR, self._attr, self._ops.getattr, nodeid, fh_or_none,
                    ctx)

    def _setattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        (valid, _, fh, size, _owner, atime, mtime, _ctime, atimensec, mtimensec, _ctimensec,
         mode, _, uid, gid, _) = abi.SETATTR_IN.unpack_from(body)
        now = time.time_ns()
        changes = SetAttr(
            size=size if valid & abi.FATTR_SIZE else None,
            mode=mode if valid & abi.FATTR_MODE else None,
            uid=uid if valid & abi.FATTR_UID else None,
            gid=gid if valid & abi.FATTR_GID else None,
            atime_ns=(now if valid & abi.FATTR_ATIME_NOW else atime * NS + atimensec
                      if valid & abi.FATTR_ATIME else None),
            mtime_ns=(now if valid & abi.FATTR_MTIME_NOW else mtime * NS + mtimensec
                      if valid & abi.FATTR_MTIME else None))
        self._spawn(unique, abi.SETATTR, self._attr, self._ops.setattr, nodeid, changes,
                    fh if valid & abi.FATTR_FH else None, ctx)

    def _readlink(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        self._spawn(unique, abi.READLINK, self._same, self._ops.readlink, nodeid, ctx)

    def _symlink(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        name, nxt = _cstr(body)
        target, _ = _cstr(body, nxt)
        self._spawn(unique, abi.SYMLINK, self._entry, self._ops.symlink, nodeid, name,
                    target, ctx)

    def _mknod(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        mode, rdev, _umask, _ = abi.MKNOD_IN.unpack_from(body)
        name, _ = _cstr(body, abi.MKNOD_IN.size)
        self._spawn(unique, abi.MKNOD, self._entry, self._ops.mknod, nodeid, name, mode,
                    rdev, ctx)

    def _mkdir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        mode, _umask = abi.MKDIR_IN.unpack_from(body)
        name, _ = _cstr(body, abi.MKDIR_IN.size)
        self._spawn(unique, abi.MKDIR, self._entry, self._ops.mkdir, nodeid, name, mode, ctx)

    def _unlink(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        name, _ = _cstr(body)
        self._spawn(unique, abi.UNLINK, self._none, self._ops.unlink, nodeid, name, ctx)

    def _rmdir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        name, _ = _cstr(body)
        self._spawn(unique, abi.RMDIR, self._none, self._ops.rmdir, nodeid, name, ctx)

    def _rename(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        newdir = abi.RENAME_IN.unpack_from(body)[0]
        self._rename_names(unique, nodeid, ctx, body, abi.RENAME_IN.size, newdir, 0)

    def _rename2(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(body)
        self._rename_names(unique, nodeid, ctx, body, abi.RENAME2_IN.size, newdir, flags)

    def _rename_names(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview,
                      start: int, newdir: int, flags: int) -> None:
        assert self._ops is not None
        old, nxt = _cstr(body, start)
        new, _ = _cstr(body, nxt)
        self._spawn(unique, abi.RENAME, self._none, self._ops.rename, nodeid, old, newdir,
                    new, flags, ctx)

    def _link(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        old = abi.LINK_IN.unpack_from(body)[0]
        name, _ = _cstr(body, abi.LINK_IN.size)
        self._spawn(unique, abi.LINK, self._entry, self._ops.link, old, nodeid, name, ctx)

    def _open(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        flags = abi.OPEN_IN.unpack_from(body)[0]
        o = self._now(unique, self._ops.open_now, nodeid, flags, ctx)
        if o is _ANSWERED:
            return
        if o is not None:
            self._reply(unique, self._opened(o))
            return
        self._spawn(unique, abi.OPEN, self._opened, self._ops.open, nodeid, flags, ctx)

    def _create(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        flags, mode, _umask, _ = abi.CREATE_IN.unpack_from(body)
        name, _ = _cstr(body, abi.CREATE_IN.size)
        self._spawn(unique, abi.CREATE, self._created, self._ops.create, nodeid, name, mode,
                    flags, ctx)

    def _read(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        self._spawn(unique, abi.READ, self._same, self._ops.read, fh, offset, size)

    def _write(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview,
               buf: bytearray) -> None:
        assert self._ops is not None and self._nursery is not None
        fh, offset, size = abi.WRITE_IN.unpack_from(body)[:3]
        data = body[abi.WRITE_IN.size:abi.WRITE_IN.size + size]
        self._nursery.start_soon(self._run, unique, abi.WRITE, _written, self._ops.write,
                                 (fh, offset, data), buf)

    def _statfs(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        self._spawn(unique, abi.STATFS, _statfs_out, self._ops.statfs, ctx)

    def _release(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        done = self._now(unique, self._ops.release_now, fh)
        if done is _ANSWERED:
            return
        if done:
            self._reply(unique, None)
            return
        self._spawn(unique, abi.RELEASE, self._none, self._ops.release, fh)

    def _fsync(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        fh, flags, _ = abi.FSYNC_IN.unpack_from(body)
        self._spawn(unique, abi.FSYNC, self._none, self._ops.fsync, fh,
                    bool(flags & abi.FSYNC_FDATASYNC))

    def _flush(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        fh = abi.FLUSH_IN.unpack_from(body)[0]
        self._spawn(unique, abi.FLUSH, self._none, self._ops.flush, fh)

    def _setxattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        size, flags = abi.GETXATTR_IN.unpack_from(body)  # (same layout: size flags)
        name, nxt = _cstr(body, 8)
        value = bytes(body[nxt:nxt + size])
        self._spawn(unique, abi.SETXATTR, self._none, self._ops.setxattr, nodeid, name,
                    value, flags, ctx)

    def _getxattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        size = abi.GETXATTR_IN.unpack_from(body)[0]
        name, _ = _cstr(body, abi.GETXATTR_IN.size)
        self._spawn(unique, abi.GETXATTR, _xattr_out(size), self._ops.getxattr, nodeid,
                    name, ctx)

    def _listxattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        size = abi.GETXATTR_IN.unpack_from(body)[0]
        encode = _xattr_out(size)
        self._spawn(unique, abi.LISTXATTR, lambda names: encode(b"".join(
            n + b"\0" for n in names)), self._ops.listxattr, nodeid, ctx)

    def _removexattr(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        name, _ = _cstr(body)
        self._spawn(unique, abi.REMOVEXATTR, self._none, self._ops.removexattr, nodeid,
                    name, ctx)

    def _opendir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        self._spawn(unique, abi.OPENDIR, self._opened, self._ops.opendir, nodeid, ctx)

    def _readdir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview,
                 plus: bool = False) -> None:
        assert self._ops is not None
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        out = DirBuffer(size, plus, self.blksize)
        self._spawn(unique, abi.READDIRPLUS if plus else abi.READDIR,
                    lambda _: out.buf, self._ops.readdir, fh, offset, out)

    def _readdirplus(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        self._readdir(unique, nodeid, ctx, body, plus=True)

    def _releasedir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        assert self._ops is not None
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        self._spawn(unique, abi.RELEASEDIR, self._none, self._ops.releasedir, fh)

    def _fsyncdir(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        self._reply(unique, None)  # directories are made durable by their own operations

    def _access(self, unique: int, nodeid: int, ctx: Ctx, body: memoryview) -> None:
        # Never sent with default_permissions (the kernel checks); answer as allowed.
        self._reply(unique, None)


def _written(n: int) -> bytes:
    return abi.WRITE_OUT.pack(n, 0)


def _statfs_out(s: StatFs) -> bytes:
    return abi.STATFS_OUT.pack(s.blocks, s.bfree, s.bfree, s.files, s.ffree, s.bsize,
                               s.namemax, s.bsize, 0)


def _xattr_out(size: int) -> Encoder:
    """getxattr/listxattr: with size 0 the caller asks how big the value is."""

    def encode(value: bytes) -> bytes:
        if size == 0:
            return abi.GETXATTR_OUT.pack(len(value), 0)
        if len(value) > size:
            raise FuseError(errno.ERANGE)
        return value

    return encode
