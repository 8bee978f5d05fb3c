"""The pyfuse3 adapter: turns kernel requests into Filesystem calls and exceptions into errno.

This is the one place where exceptions become errno values: domain errors map through
objcache.errors.errno_of, and anything unexpected is logged with its traceback and becomes
EIO, so a bug fails one request instead of taking the mount down (pyfuse3 only catches
FUSEError; anything else would escape its main loop).
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import pyfuse3
import trio

from objcache.control import ControlChannel
from objcache.core.filesystem import Filesystem
from objcache.core.inode import CTRL_INO, Attr
from objcache.errors import ObjcacheError, errno_of, unwrap
from objcache.metrics import FUSE_ERRORS, FUSE_SECONDS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
BLKSIZE = 1 << 20  # makes cat/cp use 1 MiB buffers (they size them from st_blksize)
_QUIET_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR,
                 errno.EINVAL, errno.ENAMETOOLONG, errno.EROFS}


def fuse_op(fn: F) -> F:
    name = fn.__name__
    latency = FUSE_SECONDS.labels(name)

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError as e:
            FUSE_ERRORS.labels(name, errno.errorcode.get(e.errno, str(e.errno))).inc()
            raise
        except Exception as exc:
            code = errno_of(exc)
            FUSE_ERRORS.labels(name, errno.errorcode.get(code, str(code))).inc()
            e = unwrap(exc)
            if code == errno.EIO:
                if isinstance(e, ObjcacheError):
                    log.error("%s failed: %s", name, e)  # already specific (names the key)
                else:
                    log.exception("unexpected error in %s; replying EIO", name)
            elif code not in _QUIET_ERRNOS:
                log.info("%s: %s (%s)", name, errno.errorcode.get(code, code), e)
            raise pyfuse3.FUSEError(code) from None
        finally:
            latency.observe(time.perf_counter() - t0)

    return cast(F, wrapper)


def entry(a: Attr) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = 0
    e.entry_timeout = a.cache_timeout
    e.attr_timeout = a.cache_timeout
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = a.rdev
    e.st_size = a.size
    e.st_blksize = BLKSIZE
    e.st_blocks = (a.size + 511) // 512
    e.st_atime_ns = a.atime_ns or a.mtime_ns
    e.st_mtime_ns = a.mtime_ns
    e.st_ctime_ns = a.ctime_ns or a.mtime_ns
    return e


class Operations(pyfuse3.Operations):  # type: ignore[misc]
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, control: ControlChannel,
                 notifier: KernelNotifier) -> None:
        super().__init__()
        self.fs = fs
        self.control = control
        self.notifier = notifier
        self._dirs: dict[int, list[tuple[str, Attr]]] = {}
        self._next_dir = 1

    def init(self) -> None:
        """FUSE's INIT: from now on the kernel can be told to drop what it cached."""
        self.notifier.start()

    @fuse_op
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        return entry(await self.fs.lookup(parent_inode, name))

    @fuse_op
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return entry(await self.fs.getattr(inode))

    @fuse_op
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None,
                      ctx: Any) -> Any:
        a = await self.fs.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            fh=fh,
            atime_ns=attr.st_atime_ns if fields.update_atime else None)
        return entry(a)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        try:  # forget must not raise (pyfuse3 cannot reply to it)
            self.fs.forget(inode_list)
        except Exception:
            log.exception("forget failed")

    @fuse_op
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.fs.readlink(inode)

    @fuse_op
    async def opendir(self, inode: int, ctx: Any) -> int:
        entries = await self.fs.readdir(inode)
        fh = self._next_dir
        self._next_dir += 1
        self._dirs[fh] = entries
        return fh

    @fuse_op
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        # Offsets index the snapshot taken at opendir, so entries created or removed
        # meanwhile are neither skipped nor repeated.
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, a = entries[i]
            if not pyfuse3.readdir_reply(token, name.encode(), entry(a), i + 1):
                break
            self.fs.note_lookup(a.ino)

    @fuse_op
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @fuse_op
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        return entry(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @fuse_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.rmdir(parent_inode, name)

    @fuse_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.unlink(parent_inode, name)

    @fuse_op
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> Any:
        return entry(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_op
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        return entry(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_op
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @fuse_op
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.ENOTSUP)  # S3 has no hard links

    @fuse_op
    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        if inode == CTRL_INO:
            return pyfuse3.FileInfo(fh=self.control.open(ctx.uid), direct_io=True,
                                    nonseekable=True)
        fh, keep = await self.fs.open(inode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @fuse_op
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        fh, a = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), entry(a)

    @fuse_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if self.control.owns(fh):
            return self.control.read(fh, off, size)
        return await self.fs.read(fh, off, size)

    @fuse_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if self.control.owns(fh):
            return await self.control.write(fh, buf)
        return await self.fs.write(fh, off, buf)

    @fuse_op
    async def flush(self, fh: int) -> None:
        if not self.control.owns(fh):
            await self.fs.flush(fh)

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
    async def statfs(self, ctx: Any) -> Any:
        s = self.fs.statfs()
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = s["bsize"]
        st.f_blocks = s["blocks"]
        st.f_bfree = st.f_bavail = s["bfree"]
        st.f_files = s["files"]
        st.f_ffree = st.f_favail = s["ffree"]
        st.f_namemax = s["namemax"]
        return st

    @fuse_op
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # the kernel checks permissions (default_permissions)

    @fuse_op
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        # ENOSYS: the kernel stops asking (and answers EOPNOTSUPP itself), so `ls -l`
        # does not cross into the daemon twice per file for its ACL and SELinux probes.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @fuse_op
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return []

    @fuse_op
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    @fuse_op
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)


class KernelNotifier:
    """Tells the kernel to drop what it cached of entries and inodes that changed
    elsewhere (objcache.core.filesystem.KernelNotifier). Entries go through pyfuse3's
    notify thread (invalidating from a request handler can deadlock); inodes are
    invalidated in a worker thread (it may block). Before FUSE's INIT there is nothing in
    the kernel to drop, and pyfuse3 has no session to send on: calls do nothing."""

    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(1)
        self.active = False

    def start(self) -> None:
        self.active = True

    def entry(self, parent_ino: int, name: str) -> None:
        if self.active:
            pyfuse3.invalidate_entry_async(parent_ino, name.encode(), ignore_enoent=True)

    def inode(self, ino: int) -> None:
        if self.active:
            trio.lowlevel.spawn_system_task(self._inode, ino)

    def attrs_now(self, ino: int) -> None:
        """Drop the kernel's cached attributes of `ino` before we reply to an open of it,
        so its reads go up to the new size. Attribute-only invalidation takes no inode
        lock in the kernel, so it is safe from inside the open request."""
        if not self.active:
            return
        try:
            pyfuse3.invalidate_inode(ino, True)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.info("could not invalidate attributes of inode %d: %s", ino, e)

    async def _inode(self, ino: int) -> None:
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False,
                                          limiter=self.limiter)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.info("could not invalidate inode %d: %s", ino, e)


def mount_options(allow_other: bool) -> set[str]:
    opts = set(pyfuse3.default_options)  # includes default_permissions
    # nodev/nosuid: device nodes and set-id bits stored in a bucket are shown, never honoured
    # (fusermount3 adds both for unprivileged users; root's mounts need them said).
    opts |= {"fsname=objcache", "subtype=objcache", "noatime", "nodev", "nosuid"}
    # --read-only is enforced by the daemon (EROFS on every change), not by a kernel "ro"
    # mount, because the control file must stay writable for `objcache status/umount`.
    if allow_other:
        opts.add("allow_other")
    return opts


def mount_device(mountpoint: str) -> str | None:
    """MAJOR:MINOR of the topmost mount at `mountpoint` (a resolved path), from
    /proc/self/mountinfo: never a stat of the mount, which would need our own FUSE loop.
    For FUSE the minor number is the connection's id under /sys/fs/fuse/connections."""
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == mountpoint:
                dev = parts[2]  # keep the last match: the topmost mount
    return dev


def set_read_ahead(mountpoint: str, kb: int = 1024) -> None:
    """Raise the mount's readahead so the kernel sends 1 MiB reads instead of 128 KiB.

    The device number comes from /proc/self/mountinfo, not stat(), because a stat of the
    mountpoint would need the FUSE loop that is not running yet; for the same reason
    `mountpoint` must already be a resolved path (realpath() would stat it).
    """
    dev = mount_device(mountpoint)
    try:
        if dev is None:
            raise OSError(f"{mountpoint} is not in /proc/self/mountinfo")
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as e:
        log.info("could not raise read_ahead_kb of %s (reads stay 128 KiB): %s", mountpoint, e)
