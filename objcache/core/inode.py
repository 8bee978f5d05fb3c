"""Inodes: what the filesystem knows about one key, and the s3fs-fuse metadata convention.

POSIX attributes live in object metadata as s3fs-fuse writes them (x-amz-meta-mode, -uid,
-gid, -mtime, decimal strings; a symlink is an object whose body is the target and whose
mode has S_IFLNK), so buckets are interchangeable between the two.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Any

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


class Inode:
    """Attributes:
    key: object key relative to the mount prefix ('' for the root; no trailing '/').
    etag: ETag of the S3 version the attributes describe (files and symlinks).
    meta_loaded: mode/uid/gid came from a HEAD; a LIST does not return metadata.
    checked: monotonic time the attributes were last confirmed by S3.
    children: name -> ino once the directory was listed; None before.
    in_s3: an object (or directory marker) exists in S3 under this key.
    overlay: in a cluster, the namespace entry (objcache.txn.namespace) this inode shows.
    content_gen: bumped when S3 content changed under us; opens compare it to decide
        whether the kernel may keep its page cache.
    """

    __slots__ = ("ino", "key", "mode", "size", "uid", "gid", "mtime_ns", "etag",
                 "meta_loaded", "checked", "lookups", "children", "listed", "target",
                 "in_s3", "content_gen", "kernel_gen", "created", "stale_lookups", "overlay",
                 "meta_misses", "read_children")

    def __init__(self, ino: int, key: str, mode: int, uid: int, gid: int) -> None:
        self.ino = ino
        self.key = key
        self.mode = mode
        self.size = 0
        self.uid = uid
        self.gid = gid
        self.mtime_ns = 0
        self.etag: str | None = None
        self.meta_loaded = False
        self.checked = 0.0
        self.lookups = 0
        self.children: dict[str, int] | None = None
        self.listed = 0.0
        self.stale_lookups = 0  # children looked up one by one since the last listing
        self.meta_misses = 0  # LIST-only children stat'ed since the last listing
        self.read_children = 0  # files opened in this directory since the last listing
        self.target: bytes | None = None
        self.in_s3 = False
        self.content_gen = 0
        self.kernel_gen = -1
        self.created = 0.0
        self.overlay: dict[str, Any] | None = None  # cluster: the namespace entry last applied
    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


def parent_key(key: str) -> str:
    return key.rpartition("/")[0]


def child_key(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _int(meta: dict[str, str], name: str) -> int | None:
    try:
        return int(meta[name])
    except (KeyError, ValueError):
        return None


def parse_meta(meta: dict[str, str], default_mode: int, uid: int, gid: int,
               mtime_ns: int) -> tuple[int, int, int, int]:
    """(mode, uid, gid, mtime_ns) from s3fs-style metadata, with defaults for what is
    missing or malformed."""
    mode = _int(meta, "mode")
    if mode is None:
        mode = default_mode
    elif not stat.S_IFMT(mode):
        mode |= stat.S_IFMT(default_mode)  # permission bits only: keep the object's type
    u = _int(meta, "uid")
    g = _int(meta, "gid")
    mt = meta.get("mtime")
    if mt is not None:
        try:
            mtime_ns = int(float(mt) * 1e9)
        except ValueError:
            pass
    return mode, uid if u is None else u, gid if g is None else g, mtime_ns


def make_meta(mode: int, uid: int, gid: int, mtime_ns: int) -> dict[str, str]:
    return {"mode": str(mode), "uid": str(uid), "gid": str(gid),
            "mtime": str(mtime_ns // 1_000_000_000)}
