"""Mounting and unmounting a FUSE file system: the /dev/fuse descriptor and the mount.

As root (CAP_SYS_ADMIN) the mount is made with mount(2) on a /dev/fuse we open; otherwise
fusermount3 (setuid root) mounts it and hands the descriptor back over a socket pair, the
way libfuse does. Unmounting is lazy (MNT_DETACH / `fusermount3 -u -z`): processes that
still use the mount keep it until they let go, and nobody waits on them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import stat
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

MS_NOSUID = 2
MS_NODEV = 4
MS_NOATIME = 1024
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class MountError(Exception):
    """The mount could not be made (the message names why)."""


@dataclass(frozen=True)
class MountOptions:
    fsname: str = "objcache"
    subtype: str = "objcache"
    allow_other: bool = False
    # The kernel checks permissions against the attributes we reply (mode, uid, gid).
    default_permissions: bool = True
    # Device nodes and set-id bits stored in a bucket are shown, never honoured.
    nodev: bool = True
    nosuid: bool = True
    noatime: bool = True

    def fusermount_options(self) -> str:
        opts = [f"fsname={self.fsname}", f"subtype={self.subtype}"]
        opts += [name for name, on in (("default_permissions", self.default_permissions),
                                       ("allow_other", self.allow_other),
                                       ("nodev", self.nodev), ("nosuid", self.nosuid),
                                       ("noatime", self.noatime)) if on]
        return ",".join(opts)


def mount(mountpoint: str, opts: MountOptions) -> int:
    """Mount a FUSE file system at `mountpoint` (a resolved path); its /dev/fuse fd."""
    if os.geteuid() == 0:
        try:
            return _mount_syscall(mountpoint, opts)
        except PermissionError:
            pass  # root without CAP_SYS_ADMIN (a container): fusermount3 may still work
    return _mount_fusermount(mountpoint, opts)


def _mount_syscall(mountpoint: str, opts: MountOptions) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        rootmode = stat.S_IFMT(os.stat(mountpoint).st_mode)
        data = [f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={os.getuid()}",
                f"group_id={os.getgid()}"]
        if opts.default_permissions:
            data.append("default_permissions")
        if opts.allow_other:
            data.append("allow_other")
        flags = ((MS_NOSUID if opts.nosuid else 0) | (MS_NODEV if opts.nodev else 0)
                 | (MS_NOATIME if opts.noatime else 0))
        r = _libc.mount(opts.fsname.encode(), mountpoint.encode(),
                        f"fuse.{opts.subtype}".encode(), flags, ",".join(data).encode())
        if r != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount of {mountpoint}: {os.strerror(e)}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _mount_fusermount(mountpoint: str, opts: MountOptions) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        try:
            r = subprocess.run(["fusermount3", "-o", opts.fusermount_options(), "--",
                                mountpoint], env=env, pass_fds=(theirs.fileno(),),
                               capture_output=True, text=True, timeout=60, check=False)
        except FileNotFoundError:
            raise MountError("fusermount3 is not installed (package fuse3)") from None
        theirs.close()
        if r.returncode != 0:
            raise MountError(f"fusermount3 failed: {r.stderr.strip() or r.returncode}")
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise MountError("fusermount3 sent no /dev/fuse descriptor")
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def unmount(mountpoint: str) -> None:
    """Detach the mount lazily; nothing if it is not mounted (any more)."""
    if os.geteuid() == 0:
        if _libc.umount2(mountpoint.encode(), MNT_DETACH) == 0:
            return
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOENT):
            return  # not a mount point any more
        if e != errno.EPERM:
            log.warning("unmount of %s failed: %s", mountpoint, os.strerror(e))
            return
    r = subprocess.run(["fusermount3", "-u", "-z", "--", mountpoint], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0 and "not mounted" not in r.stderr and "not found" not in r.stderr:
        log.warning("fusermount3 -u -z %s failed: %s", mountpoint, r.stderr.strip())


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
