"""The operations adapter: kernel requests (decoded by objcache.fs.kernel) become
Filesystem calls, and exceptions become errno.

This is the one place where exceptions become errno values: domain errors map through
objcache.errors.errno_of, and anything unexpected is logged with its traceback and becomes
EIO, so a bug fails one request instead of taking the mount down.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import trio

from objcache.control import ControlChannel
from objcache.core.filesystem import Filesystem
from objcache.core.inode import CTRL_INO, Attr
from objcache.errors import ObjcacheError, errno_of, unwrap
from objcache.fs.kernel import (
    Ctx,
    DirBuffer,
    FuseError,
    FuseSession,
    Opened,
    SetAttr,
    StatFs,
)
from objcache.fs.mounting import MountOptions
from objcache.metrics import FUSE_ERRORS, FUSE_SECONDS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
G = TypeVar("G", bound=Callable[..., Any])
BLKSIZE = 1 << 20  # makes cat/cp use 1 MiB buffers (they size them from st_blksize)
INODE_SETTLE_WAIT = 0.5  # an open waits this long for its inode's invalidations to be sent
_QUIET_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR,
                 errno.EINVAL, errno.ENAMETOOLONG, errno.EROFS}
ENOATTR = errno.ENODATA


def _fuse_error(name: str, exc: BaseException) -> FuseError:
    """The one mapping of exceptions to errno (logged as they deserve)."""
    if isinstance(exc, FuseError):
        FUSE_ERRORS.labels(name, errno.errorcode.get(exc.errno, str(exc.errno))).inc()
        return exc
    code = errno_of(exc)
    FUSE_ERRORS.labels(name, errno.errorcode.get(code, str(code))).inc()
    e = unwrap(exc)
    if code == errno.EIO:
        if isinstance(e, ObjcacheError):
            log.error("%s failed: %s", name, e)  # already specific (names the key)
        else:
            log.error("unexpected error in %s; replying EIO", name, exc_info=exc)
    elif code not in _QUIET_ERRNOS:
        log.info("%s: %s (%s)", name, errno.errorcode.get(code, code), e)
    else:
        # (an application's everyday answers; the reason, for a campaign's logs)
        log.debug("%s: %s (%s)", name, errno.errorcode.get(code, code), e)
    return FuseError(code)


def fuse_op(fn: F) -> F:
    name = fn.__name__
    latency = FUSE_SECONDS.labels(name)

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(self, *args)
        except Exception as exc:
            raise _fuse_error(name, exc) from None
        finally:
            latency.observe(time.perf_counter() - t0)

    return cast(F, wrapper)


def fuse_op_now(name: str) -> Callable[[G], G]:
    """fuse_op for the synchronous fast path of operation `name` (its metrics)."""
    latency = FUSE_SECONDS.labels(name)

    def wrap(fn: G) -> G:
        @functools.wraps(fn)
        def wrapper(self: Operations, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            except Exception as exc:
                raise _fuse_error(name, exc) from None
            finally:
                latency.observe(time.perf_counter() - t0)

        return cast(G, wrapper)

    return wrap


class Operations:
    """objcache.fs.kernel.Operations over the filesystem core and the control file."""

    def __init__(self, fs: Filesystem, control: ControlChannel,
                 notifier: KernelNotifier) -> None:
        self.fs = fs
        self.control = control
        self.notifier = notifier
        self._dirs: dict[int, list[tuple[str, int, int]]] = {}
        self._next_dir = 1

    def initialized(self, session: FuseSession) -> None:
        """FUSE's INIT: from now on the kernel can be told to drop what it cached."""
        self.notifier.start()

    def forget(self, items: Sequence[tuple[int, int]]) -> None:
        self.fs.forget(items)

    @fuse_op_now("lookup")
    def lookup_now(self, parent: int, name: bytes) -> Attr | None:
        return self.fs.lookup_now(parent, name)

    @fuse_op
    async def lookup(self, parent: int, name: bytes, ctx: Ctx) -> Attr:
        return await self.fs.lookup(parent, name)

    @fuse_op_now("getattr")
    def getattr_now(self, ino: int, fh: int | None) -> Attr | None:
        return self.fs.getattr_now(ino)

    @fuse_op
    async def getattr(self, ino: int, fh: int | None, ctx: Ctx) -> Attr:
        return await self.fs.getattr(ino)

    @fuse_op
    async def setattr(self, ino: int, changes: SetAttr, fh: int | None, ctx: Ctx) -> Attr:
        return await self.fs.setattr(ino, size=changes.size, mode=changes.mode,
                                     uid=changes.uid, gid=changes.gid,
                                     mtime_ns=changes.mtime_ns, fh=fh,
                                     atime_ns=changes.atime_ns)

    @fuse_op
    async def readlink(self, ino: int, ctx: Ctx) -> bytes:
        return await self.fs.readlink(ino)

    @fuse_op
    async def opendir(self, ino: int, ctx: Ctx) -> Opened:
        entries, same = await self.fs.opendir(ino)
        fh = self._next_dir
        self._next_dir += 1
        self._dirs[fh] = entries
        # The kernel caches the listing it reads (CACHE_DIR) and keeps it for the next
        # opendir while it is the same (KEEP_CACHE): a warm `ls` reads nothing from us.
        return Opened(fh, keep_cache=same, cache_dir=True)

    @fuse_op
    async def readdir(self, fh: int, offset: int, out: DirBuffer) -> None:
        # Offsets index the snapshot taken at opendir, so entries created or removed
        # meanwhile are neither skipped nor repeated.
        entries = self._dirs.get(fh, [])
        for i in range(offset, len(entries)):
            name, ino, mode = entries[i]
            a = self.fs.listed_attr(ino)  # (None: gone since; listed without attributes)
            if not out.add(name.encode(), ino, mode, a, i + 1):
                break
            if out.plus and a is not None:
                self.fs.note_lookup(ino)

    @fuse_op
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @fuse_op
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> Attr:
        return await self.fs.mkdir(parent, name, mode, ctx.uid, ctx.gid)

    @fuse_op
    async def rmdir(self, parent: int, name: bytes, ctx: Ctx) -> None:
        await self.fs.rmdir(parent, name)

    @fuse_op
    async def unlink(self, parent: int, name: bytes, ctx: Ctx) -> None:
        await self.fs.unlink(parent, name)

    @fuse_op
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        return await self.fs.mknod(parent, name, mode, rdev, ctx.uid, ctx.gid)

    @fuse_op
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> Attr:
        return await self.fs.symlink(parent, name, target, ctx.uid, ctx.gid)

    @fuse_op
    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
                     flags: int, ctx: Ctx) -> None:
        await self.fs.rename(parent, name, new_parent, new_name, flags)

    @fuse_op
    async def link(self, ino: int, new_parent: int, new_name: bytes, ctx: Ctx) -> Attr:
        raise FuseError(errno.ENOTSUP)  # S3 has no hard links

    @fuse_op_now("open")
    def open_now(self, ino: int, flags: int, ctx: Ctx) -> Opened | None:
        if ino == CTRL_INO:
            return Opened(self.control.open(ctx.uid), direct_io=True, nonseekable=True)
        got = self.fs.open_now(ino, flags)
        return self._opened(*got) if got is not None else None

    @fuse_op
    async def open(self, ino: int, flags: int, ctx: Ctx) -> Opened:
        return self._opened(*await self.fs.open(ino, flags))

    def _opened(self, fh: int, keep: bool, backing_id: int) -> Opened:
        return Opened(fh, keep_cache=keep, backing_id=backing_id,
                      noflush=not self.fs.flushes(fh))

    @fuse_op
    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[Opened, Attr]:
        fh, a, backing_id = await self.fs.create(parent, name, mode, flags, ctx.uid, ctx.gid)
        return Opened(fh, keep_cache=True, backing_id=backing_id), a

    @fuse_op
    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        if self.control.owns(fh):
            return self.control.read(fh, offset, size)
        return await self.fs.read(fh, offset, size)

    @fuse_op
    async def write(self, fh: int, offset: int, data: memoryview) -> int:
        if self.control.owns(fh):
            return await self.control.write(fh, data)
        return await self.fs.write(fh, offset, data)

    @fuse_op
    async def flush(self, fh: int) -> None:
        if not self.control.owns(fh):
            await self.fs.flush(fh)

    @fuse_op_now("release")
    def release_now(self, fh: int) -> bool:
        if self.control.owns(fh):
            self.control.release(fh)
            return True
        return self.fs.release_now(fh)

    @fuse_op
    async def release(self, fh: int) -> None:
        if self.control.owns(fh):
            self.control.release(fh)
        else:
            await self.fs.release(fh)

    @fuse_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        if not self.control.owns(fh):
            await self.fs.fsync(fh)

    @fuse_op
    async def statfs(self, ctx: Ctx) -> StatFs:
        s = self.fs.statfs()
        return StatFs(s["bsize"], s["blocks"], s["bfree"], s["files"], s["ffree"],
                      s["namemax"])

    @fuse_op
    async def getxattr(self, ino: int, name: bytes, ctx: Ctx) -> bytes:
        # ENOSYS: the kernel stops asking (and answers EOPNOTSUPP itself), so `ls -l`
        # does not cross into the daemon twice per file for its ACL and SELinux probes.
        raise FuseError(errno.ENOSYS)

    @fuse_op
    async def listxattr(self, ino: int, ctx: Ctx) -> list[bytes]:
        return []

    @fuse_op
    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int,
                       ctx: Ctx) -> None:
        raise FuseError(errno.ENOTSUP)

    @fuse_op
    async def removexattr(self, ino: int, name: bytes, ctx: Ctx) -> None:
        raise FuseError(ENOATTR)


class SessionBacking:
    """objcache.core.passthrough.Backing through the FUSE session."""

    def __init__(self, session: FuseSession) -> None:
        self.session = session

    @property
    def available(self) -> bool:
        return self.session.passthrough

    @property
    def why_not(self) -> str:
        return self.session.passthrough_off

    def open(self, fd: int) -> int:
        return self.session.backing_open(fd)

    def close(self, backing_id: int) -> None:
        self.session.backing_close(backing_id)


class FuseReport:
    """The FUSE part of `objcache status` (objcache.status.FuseStatus)."""

    def __init__(self, session: FuseSession, fs: Filesystem) -> None:
        self.session = session
        self.fs = fs

    def fuse(self) -> dict[str, Any]:
        pt = self.fs.passthrough
        s = self.session
        return {"mode": pt.mode(), "protocol": f"7.{s.proto_minor}",
                "passthrough_opens": pt.opens, "daemon_opens": pt.daemon_opens,
                "daemon_read_bytes": pt.read_bytes, "daemon_written_bytes": pt.written_bytes,
                # files written without the daemon (passthrough, shared mappings) that it
                # looks at for changes
                "watched_files": len(self.fs.local.watched),
                "requests": s.requests, "requests_by_op": s.counts()}


class KernelNotifier:
    """Tells the kernel to drop what it cached of entries and inodes that changed
    elsewhere (objcache.core.filesystem.KernelNotifier), through the FUSE session. Entry
    and page invalidations run in a worker thread (the kernel may take a lock a request
    we serve holds). Before FUSE's INIT there is nothing in the kernel to drop: calls do
    nothing."""

    def __init__(self, session: FuseSession) -> None:
        self.session = session
        self.active = False
        self._inflight: dict[int, int] = {}  # inode invalidations on their way, by inode
        self._sent = trio.lowlevel.ParkingLot()

    def start(self) -> None:
        self.active = True

    def entry(self, parent_ino: int, name: str) -> None:
        if self.active:
            trio.lowlevel.spawn_system_task(self.session.invalidate_entry, parent_ino,
                                            name.encode())

    def delete(self, parent_ino: int, ino: int, name: str) -> None:
        if self.active:
            trio.lowlevel.spawn_system_task(self.session.notify_delete, parent_ino, ino,
                                            name.encode())

    def inode(self, ino: int) -> None:
        if self.active:
            self._inflight[ino] = self._inflight.get(ino, 0) + 1
            trio.lowlevel.spawn_system_task(self._invalidate_inode, ino)

    async def _invalidate_inode(self, ino: int) -> None:
        try:
            await self.session.invalidate_inode(ino)
        finally:
            left = self._inflight.pop(ino) - 1
            if left:
                self._inflight[ino] = left
            self._sent.unpark_all()

    async def inode_settled(self, ino: int) -> None:
        """Until the invalidations of `ino` on their way were sent, INODE_SETTLE_WAIT at
        most: the kernel may hold a lock the invalidation needs until the request that
        waits here is answered (it then goes on as before)."""
        with trio.move_on_after(INODE_SETTLE_WAIT):
            while ino in self._inflight:
                await self._sent.park()

    def attrs_now(self, ino: int) -> None:
        """Drop the kernel's cached attributes of `ino` before we reply to an open of it,
        so its reads go up to the new size. Attribute-only invalidation takes no inode
        lock in the kernel, so it is safe from inside the open request."""
        if self.active:
            self.session.invalidate_attrs_now(ino)


def mount_options(allow_other: bool) -> MountOptions:
    # --read-only is enforced by the daemon (EROFS on every change), not by a kernel "ro"
    # mount, because the control file must stay writable for `objcache status/umount`.
    return MountOptions(allow_other=allow_other)
