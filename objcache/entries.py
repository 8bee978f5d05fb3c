"""The typed vocabulary of namespace entries: what a file, directory or deletion is when it
is not (only) an S3 object.

The replicated namespace (objcache.txn.namespace) keeps one entry per key; the filesystem
core shows them; commands carry them on the wire as plain maps (`to_wire`/`*_from_wire`,
which validate). Entries are immutable values: a change makes a new one.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Attrs:
    """POSIX attributes of a file or directory (mode includes the type bits).

    atime_ns/ctime_ns 0: not known, shown as mtime. rdev: the device number of a character
    or block device."""

    mode: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0

    def with_perms(self, perms: int) -> Attrs:
        return replace(self, mode=stat.S_IFMT(self.mode) | (perms & 0o7777))

    def changed_at(self, now_ns: int) -> Attrs:
        """The same attributes after a change at `now_ns` (which moves ctime)."""
        return replace(self, ctime_ns=now_ns)

    @property
    def shown_atime(self) -> int:
        return self.atime_ns or self.mtime_ns

    @property
    def shown_ctime(self) -> int:
        return self.ctime_ns or self.mtime_ns


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One version of an S3 object."""

    key: str
    etag: str
    size: int


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file or symlink whose content S3 does not hold (yet) under its key.

    Its content is one of: the sealed blob `cid` held by the nodes in `holders` (a closed,
    not yet uploaded file); the S3 object `base` (a renamed or re-attributed clean file,
    copied server-side at write-back); the symlink `target`; or nothing (an empty file).
    `at` is the wall-clock time of the change (write-back waits a delay after it); `ver`
    the log position of the change (write-back clears only an unchanged entry)."""

    attrs: Attrs
    size: int = 0
    cid: str | None = None
    holders: tuple[str, ...] = ()
    base: ObjectRef | None = None
    target: bytes | None = None
    at: float = 0.0
    ver: int = 0

    @property
    def content(self) -> tuple[object, ...]:
        """What identifies the bytes (attribute changes leave it equal)."""
        return (self.cid, self.base, self.size, self.target)


@dataclass(frozen=True, slots=True)
class DirEntry:
    """A directory created or re-attributed here: its marker is due in S3."""

    attrs: Attrs
    at: float = 0.0
    ver: int = 0


@dataclass(frozen=True, slots=True)
class Tombstone:
    """An S3 object that was unlinked or renamed away: hidden now, deleted at write-back."""

    at: float = 0.0
    ver: int = 0


Entry = FileEntry | DirEntry | Tombstone
Live = FileEntry | DirEntry


# -- the wire form (msgpack maps in Raft commands) ----------------------------------------

def attrs_from_wire(d: dict[str, Any]) -> Attrs:
    return Attrs(int(d["mode"]), int(d["uid"]), int(d["gid"]), int(d["mtime"]),
                 int(d.get("atime", 0)), int(d.get("ctime", 0)), int(d.get("rdev", 0)))


def attrs_wire(a: Attrs) -> dict[str, Any]:
    return {"mode": a.mode, "uid": a.uid, "gid": a.gid, "mtime": a.mtime_ns,
            "atime": a.atime_ns, "ctime": a.ctime_ns, "rdev": a.rdev}


def file_from_wire(d: dict[str, Any]) -> FileEntry:
    """A validated file entry from a command (TypeError/KeyError/ValueError if malformed)."""
    cid = d.get("cid")
    if cid is not None and not isinstance(cid, str):
        raise TypeError("cid must be a string")
    b = d.get("base")
    if b is not None and not (isinstance(b, list | tuple) and len(b) == 3
                              and isinstance(b[0], str) and isinstance(b[1], str)
                              and isinstance(b[2], int)):
        raise TypeError("base must be [key, etag, size]")
    target = d.get("target")
    if target is not None and not isinstance(target, bytes):
        raise TypeError("target must be bytes")
    holders = d.get("holders") or []
    if not isinstance(holders, list | tuple):
        raise TypeError("holders must be a list")
    return FileEntry(attrs_from_wire(d), int(d.get("size", 0)), cid, tuple(str(h) for h in holders),
                     ObjectRef(b[0], b[1], b[2]) if b is not None else None, target,
                     float(d.get("at", 0)))


def dir_from_wire(d: dict[str, Any]) -> DirEntry:
    return DirEntry(attrs_from_wire(d), float(d.get("at", 0)))


def to_wire(e: Entry) -> dict[str, Any]:
    """The map a command carries (and the digest hashes); `ver` is assigned at apply."""
    if isinstance(e, FileEntry):
        return {"t": "f", **attrs_wire(e.attrs), "size": e.size, "cid": e.cid,
                "holders": list(e.holders),
                "base": [e.base.key, e.base.etag, e.base.size] if e.base else None,
                "target": e.target, "at": e.at, "ver": e.ver}
    if isinstance(e, DirEntry):
        return {"t": "d", **attrs_wire(e.attrs), "at": e.at, "ver": e.ver}
    return {"t": "x", "at": e.at, "ver": e.ver}


@dataclass(frozen=True, slots=True)
class NsChange:
    """What one applied command did to one key: its entry now (None: it has none), and
    for write-back, the S3 version that now holds it."""

    key: str
    entry: Entry | None
    uploaded: ObjectRef | None = None
    moved: bool = field(default=False)  # left this key for another (rename)
    # left the namespace while this node was behind (a snapshot replaced its state): S3
    # holds it now, or it is gone; which, only S3 can say
    resync: bool = field(default=False)


@dataclass(frozen=True, slots=True)
class FlushScope:
    """What a flush covers: every dirty key ("all"), what this node owns or holds ("mine"),
    or one key and everything under it ("key"). Typed, so that no file name can be
    mistaken for a keyword."""

    kind: str
    key: str = ""

    @classmethod
    def everything(cls) -> FlushScope:
        return cls("all")

    @classmethod
    def mine(cls) -> FlushScope:
        return cls("mine")

    @classmethod
    def under(cls, key: str) -> FlushScope:
        """`key` and everything below it; '' (the root) is everything."""
        return cls("key", key.rstrip("/")) if key.strip("/") else cls("all")

    def covers(self, key: str) -> bool:
        """Whether a dirty `key` is in scope (for kinds other than "mine")."""
        if self.kind == "all":
            return True
        k = key.rstrip("/")
        return k == self.key or k.startswith(self.key + "/")
