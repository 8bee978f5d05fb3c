"""Inodes: what the filesystem core knows about one key, and the attributes it replies."""

from __future__ import annotations

import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from objcache.entries import Attrs, DirEntry, FileEntry

if TYPE_CHECKING:
    from objcache.core.passthrough import Backed

ROOT_INO = 1
CTRL_INO = 0xFFFF_FFFF  # the control file; far above any inode number we hand out

DEFAULT_FILE_MODE = stat.S_IFREG | 0o644
DEFAULT_DIR_MODE = stat.S_IFDIR | 0o755
SYMLINK_MODE = stat.S_IFLNK | 0o777


@dataclass(slots=True)
class Attr:
    """Attributes as the FUSE adapter replies them; `cache_timeout` is for the kernel."""

    ino: int
    mode: int
    size: int
    uid: int
    gid: int
    mtime_ns: int
    cache_timeout: float
    nlink: int = 1
    atime_ns: int = 0  # 0: as mtime
    ctime_ns: int = 0
    rdev: int = 0


class Inode:
    """Attributes:
    key: object key relative to the mount prefix ('' for the root; no trailing '/').
    etag: ETag of the S3 version the attributes describe (files and symlinks).
    modified: that version's Last-Modified second, as LIST and HEAD give it: a metadata
        rewrite (a copy onto itself) keeps the ETag and moves this.
    meta_loaded: mode/uid/gid came from a HEAD (or an entry); a LIST does not return
        metadata.
    checked: monotonic time the attributes were last confirmed.
    children: name -> ino once the directory was listed; None before.
    in_s3: an object (or directory marker) exists in S3 under this key.
    overlay: the backend's entry this inode shows (files and directories changed in a
        cluster and not written back yet), if any.
    content_gen: bumped when the content changed under us; opens compare it to decide
        whether the kernel may keep its page cache.
    backed: the backing file of its passthrough opens, while it has some.
    daemon_opens: its opens served by the daemon (the kernel allows no mix of the two).
    kernel_listing: a directory's listing as the kernel was last given it (a hash of its
        (name, inode) pairs): while unchanged, the kernel's cached copy is current.
    """

    __slots__ = ("ino", "key", "mode", "size", "uid", "gid", "mtime_ns", "atime_ns",
                 "ctime_ns", "rdev", "etag",
                 "meta_loaded", "checked", "lookups", "children", "listed", "target",
                 "in_s3", "content_gen", "kernel_gen", "created", "stale_lookups", "overlay",
                 "read_children", "modified", "backed", "daemon_opens",
                 "kernel_listing")

    def __init__(self, ino: int, key: str, mode: int, uid: int, gid: int) -> None:
        self.ino = ino
        self.key = key
        self.mode = mode
        self.size = 0
        self.uid = uid
        self.gid = gid
        self.mtime_ns = 0
        self.atime_ns = 0
        self.ctime_ns = 0
        self.rdev = 0
        self.etag: str | None = None
        self.modified = 0  # S3's Last-Modified of that version, in seconds (0: not known)
        self.meta_loaded = False
        self.checked = 0.0
        self.lookups = 0
        self.children: dict[str, int] | None = None
        self.listed = 0.0
        self.stale_lookups = 0  # children looked up one by one since the last listing
        self.read_children = 0  # files opened in this directory since the last listing
        self.target: bytes | None = None
        self.in_s3 = False
        self.content_gen = 0
        self.kernel_gen = -1
        self.created = 0.0
        self.overlay: FileEntry | DirEntry | None = None
        self.backed: Backed | None = None
        self.daemon_opens = 0
        self.kernel_listing: int | None = None

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    @property
    def detached(self) -> bool:
        """Unlinked (or replaced) while the kernel or an open handle still knows it."""
        return self.key.startswith("\0")

    @property
    def attrs(self) -> Attrs:
        return Attrs(self.mode, self.uid, self.gid, self.mtime_ns, self.atime_ns,
                     self.ctime_ns, self.rdev)

    def set_attrs(self, a: Attrs) -> None:
        self.mode, self.uid, self.gid, self.mtime_ns = a.mode, a.uid, a.gid, a.mtime_ns
        self.atime_ns, self.ctime_ns, self.rdev = a.atime_ns, a.ctime_ns, a.rdev

    def changed(self) -> None:
        """A directory's entries changed now: mtime and ctime move."""
        self.mtime_ns = self.ctime_ns = time.time_ns()


def parent_key(key: str) -> str:
    return key.rpartition("/")[0]


def child_key(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name
