"""The filesystem core: every POSIX operation, its checks, and the inode and handle tables.

It knows nothing about FUSE (objcache.fs.operations adapts it), so tests drive it
directly. It shows S3 (listings and HEADs, cached for `--metadata-ttl`) with what its
backend (objcache.backend) knows beyond S3 on top: entries of files and directories
changed in a cluster and not written back yet, and this node's working copies of written
files. Each operation runs its checks here once, then asks the backend to make the change
real: S3 at once and the local journal on one node, a Raft transaction in a cluster.
Changes made elsewhere (another node's, a finished upload) reach the inodes through
`Backend.take_changes`, and the kernel is told to drop what it cached of them.

All state is owned by the trio thread.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import trio

from objcache import CTRL_NAME
from objcache.backend.base import Backend, Change, Moved, NsView
from objcache.cache.localfiles import LocalFile, LocalFiles
from objcache.cache.objmeta import NO_OBJECT_META, ObjectMetaSource, modified_s
from objcache.config import MountConfig
from objcache.core.handles import EMPTY, BlobSource, FileHandle, ObjectSource, Source
from objcache.core.inode import (
    CTRL_INO,
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    ROOT_INO,
    SYMLINK_MODE,
    Attr,
    Inode,
    child_key,
    parent_key,
)
from objcache.core.passthrough import NO_PASSTHROUGH, Backed, Passthrough, writer_headroom
from objcache.entries import Attrs, DirEntry, FileEntry, FlushScope, ObjectRef
from objcache.errors import (
    Exists,
    FileTooBig,
    Invalid,
    IsADirectory,
    NameTooLong,
    NoQuorum,
    NotADirectory,
    NotEmpty,
    NotFound,
    ObjcacheError,
    ReadOnly,
    StaleObject,
    first_error,
)
from objcache.store.meta import parse_meta
from objcache.store.parts import max_size
from objcache.ticks import sleep_ticks

if TYPE_CHECKING:
    from objcache.cache.router import ChunkRouter
    from objcache.store import ObjectInfo

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024  # S3's limit on a key
NAME_MAX = 255  # what statfs reports as f_namemax
MAX_OBJECT = 5 << 40  # S3's limit on an object
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
MAX_LIST_MOVES = 8  # renames here a listing follows before it gives up (ENOENT)
# What a non-directory may be: the kernel opens FIFOs, sockets and devices itself (FUSE only
# creates, stats, re-attributes, renames and removes them).
SPECIAL_TYPES = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)
FILE_TYPES = (stat.S_IFREG, stat.S_IFLNK, *SPECIAL_TYPES)

RELIST_AFTER_STALE_LOOKUPS = 16
# Directories the kernel forgot keep their listings while fewer inodes than this are known
# (an inode is a few hundred bytes).
MAX_KEPT_INODES = 200_000
# How long a removal is remembered against LISTs that read S3 before it (a listing of
# a big directory takes seconds; none takes this long).
REMOVED_MEMORY = 600.0
# A stat of a file known only from a LIST costs a HEAD (S3 lists no metadata). When such
# stats sweep a listed directory in listing order (`ls -l`, `du`, a reader going through
# its files), the rest of the directory is HEADed in the background by META_PREFETCH
# tasks (META_BATCH HEADs each at a time; one GET each where files are being read), from
# there: the stats then find their answer in flight or done instead of paying
# one round trip each in sequence. Random stats never start it (every HEAD fetched ahead
# would be a wasted, billed request); a sweep is META_PREFETCH_AFTER stats in a row, each
# within META_SWEEP_SLACK entries of the furthest one so far.
META_PREFETCH_AFTER = 6
META_SWEEP_SLACK = 8
META_PREFETCH = 16
# HEADs one prefetch task sends at once (the store's batch path: one task per batch, not
# per HEAD; a 10,000-entry cold `ls -l` on loopback went from 4.7 s to 3.4 s).
META_BATCH = 16
# How far ahead of the furthest stat it runs (a sweep that stops has fetched at most
# this many for nothing).
META_PREFETCH_WINDOW = 512
META_READ_WINDOW = 64  # the same, in a directory whose files are being read
MAX_SWEEPS = 4096  # directories whose stats are being followed
# Prefetched HEADs that no stat used, over all directories: above this share of what was
# prefetched (once META_WASTE_MIN were), no new prefetch starts.
META_WASTE_SHARE = 0.25
META_WASTE_MIN = 256
# A pause lasts this long, then the tallies start over: a pause that only a prefetch could
# end never ended (one 10,000-entry cold `ls -l` on a WAN-like S3 took 272 s, one round
# trip per entry, against 6 s).
META_WASTE_PAUSE = 30.0
# How often files written through passthrough are looked at (their size and times: the
# kernel tells us nothing of those writes; streaming write-back follows the size).
BYPASS_LOOK = 0.25
# How long an open waits for the chunks of its object that are being written to the cache
# disk, when they are all that keeps it from being passed through.
LANDING_PATIENCE = 2.0


def _mappable(flags: int) -> bool:
    """Whether an open with these flags may map the file shared and writable."""
    return flags & os.O_ACCMODE == os.O_RDWR


class KernelNotifier(Protocol):
    """What the FUSE layer does when something we told the kernel changed elsewhere."""

    def entry(self, parent_ino: int, name: str) -> None: ...

    def delete(self, parent_ino: int, ino: int, name: str) -> None: ...

    def inode(self, ino: int) -> None: ...

    def attrs_now(self, ino: int) -> None: ...

    async def inode_settled(self, ino: int) -> None:
        """Return once no invalidation of `ino` sent by `inode` is on its way (bounded)."""
        ...


class NoNotifier:
    """No kernel to tell (the core driven without FUSE)."""

    def entry(self, parent_ino: int, name: str) -> None:
        pass

    def delete(self, parent_ino: int, ino: int, name: str) -> None:
        pass

    def inode(self, ino: int) -> None:
        pass

    def attrs_now(self, ino: int) -> None:
        pass

    async def inode_settled(self, ino: int) -> None:
        pass


NO_NOTIFIER = NoNotifier()


class _Sweep:
    """Where one listed directory's LIST-only stats fall in its listing order."""

    def __init__(self, children: dict[str, int]) -> None:
        self.children = children
        self.names = sorted(children)
        self.top = -1  # the furthest position stat'ed
        self.length = 0  # stats in a row near `top`

    def saw(self, name: str) -> int:
        """Count a stat of `name`; the length of the sweep it belongs to."""
        i = bisect.bisect_left(self.names, name)
        if i >= len(self.names) or self.names[i] != name:
            return self.length
        if self.top >= 0 and abs(i - self.top) <= META_SWEEP_SLACK and i != self.top:
            self.length += 1
        else:
            self.length = 1
        self.top = max(self.top, i) if self.length > 1 else i
        return self.length


class _MetaPrefetch:
    """One directory's background HEADs, in listing order from where a sweep started."""

    def __init__(self, d: Inode, after: str) -> None:
        self.dir = d
        self.children = d.children or {}
        self.names = sorted(self.children)
        start = bisect.bisect_right(self.names, after)
        self.names = self.names[start:] + self.names[:start]
        self._pos = {n: i for i, n in enumerate(self.names)}
        self.next = 0  # index in `names` of the next one to fetch
        self.cursor = 0  # index of the furthest one stat'ed by a caller
        self.fetched: set[int] = set()  # indexes HEADed ahead and not stat'ed yet
        self.used = 0  # of those, how many a stat then asked for
        self.moved = trio.Event()

    def saw(self, name: str) -> None:
        i = self._pos.get(name)
        if i is None:
            return
        if i in self.fetched:
            self.fetched.discard(i)
            self.used += 1
        if i > self.cursor:
            self.cursor = i
            self.moved.set()
            self.moved = trio.Event()

    def window(self, reading: bool) -> int:
        # (A window growing with the sweep, a quarter of it, was tried: a 10,000-entry
        # `ls -l` on a WAN-like S3 took 78-95 s against 23 s with the full window.)
        return META_READ_WINDOW if reading else META_PREFETCH_WINDOW


def _name(name: bytes | str) -> str:
    if len(name if isinstance(name, bytes) else name.encode()) > NAME_MAX:
        raise NameTooLong(f"a name of more than {NAME_MAX} bytes")
    if isinstance(name, bytes):
        try:
            name = name.decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid("file names must be UTF-8 (S3 keys are)") from None
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise Invalid(name)
    return name


def _valid_listed(name: str) -> bool:
    return bool(name) and name not in (".", "..", CTRL_NAME) and "/" not in name


def _new_attrs(cur: Attrs, mode: int | None, uid: int | None, gid: int | None,
               mtime_ns: int | None, atime_ns: int | None = None) -> Attrs:
    """`cur` with what a setattr gives; any change moves ctime (POSIX: chmod, chown and
    utimensat do, even to the same values)."""
    if mode is None and uid is None and gid is None and mtime_ns is None and atime_ns is None:
        return cur
    return Attrs(cur.mode if mode is None else stat.S_IFMT(cur.mode) | (mode & 0o7777),
                 cur.uid if uid is None else uid, cur.gid if gid is None else gid,
                 cur.mtime_ns if mtime_ns is None else mtime_ns,
                 cur.atime_ns if atime_ns is None else atime_ns, time.time_ns(), cur.rdev)


class Filesystem:
    """Attributes:
    inodes: ino -> Inode for everything the kernel or a listing may refer to.
    by_key: key -> ino (at most one live inode per key).
    handles: fh -> FileHandle.
    """

    def __init__(self, cfg: MountConfig, backend: Backend, router: ChunkRouter,
                 local: LocalFiles, notifier: KernelNotifier = NO_NOTIFIER,
                 meta: ObjectMetaSource = NO_OBJECT_META,
                 passthrough: Passthrough = NO_PASSTHROUGH) -> None:
        self.cfg = cfg
        self.passthrough = passthrough
        self.meta = meta
        self.backend = backend
        self.store = backend.store
        self.router = router
        self.local = local
        self.notify = notifier
        # Objects without metadata belong to whoever runs the daemon.
        self.uid, self.gid = os.getuid(), os.getgid()
        self.ttl = cfg.metadata_ttl
        self.readahead_chunks = max(1, cfg.readahead // cfg.chunk_size)
        # S3 allows 5 TiB per object; the part schedule may allow less with small chunks
        self.max_file_size = min(max_size(cfg.chunk_size), MAX_OBJECT)
        self.inodes: dict[int, Inode] = {}
        self.by_key: dict[str, int] = {}
        self.handles: dict[int, FileHandle] = {}
        self._next_ino = ROOT_INO + 1
        self._next_fh = 1
        self._head_inflight: dict[str, trio.Event] = {}
        self._list_inflight: dict[int, trio.Event] = {}
        # Entries that another node's changes added to a directory while a listing of it
        # was in flight and before it had one (by directory inode, one map per listing).
        self._arrived: dict[int, list[dict[str, int]]] = {}
        self._background: trio.Nursery | None = None
        self._meta_prefetching: dict[int, _MetaPrefetch] = {}  # by directory inode
        self._sweeps: dict[int, _Sweep] = {}  # by directory inode
        self._prefetched = 0  # HEADs made ahead of stats (decayed)
        self._prefetch_wasted = 0  # of those, the ones no stat asked for
        self._prefetch_paused: float | None = None  # since when the waste pauses it
        self._making: dict[str, trio.Event] = {}  # working copies being made, by key
        # When names were removed (monotonic), so that a LIST that read S3 before a
        # removal does not bring the name back; kept for REMOVED_MEMORY seconds.
        self._removed: dict[str, float] = {}
        root = Inode(ROOT_INO, "", DEFAULT_DIR_MODE, self.uid, self.gid)
        root.mtime_ns = time.time_ns()
        root.lookups = 1
        self.inodes[ROOT_INO] = root
        self.by_key[""] = ROOT_INO
        self.mount_time_ns = root.mtime_ns

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the nursery of background metadata prefetches, and apply what the backend
        reports changed."""
        async with trio.open_nursery() as nursery:
            self._background = nursery
            nursery.start_soon(self._look_at_bypassed)
            task_status.started()
            try:
                while True:
                    await self.backend.wait_changes()
                    self._apply_changes(self.backend.take_changes())
            finally:
                self._background = None

    async def _look_at_bypassed(self) -> None:
        while True:
            await sleep_ticks(BYPASS_LOOK)
            if self.local.watched:
                self.local.observe_all()

    # -- inode table ----------------------------------------------------------------------

    def _new_inode(self, key: str, mode: int) -> Inode:
        old = self.by_key.get(key)
        if old is not None and old in self.inodes:
            self._detach(self.inodes[old])
        ino = self._next_ino
        self._next_ino += 1
        inode = Inode(ino, key, mode, self.uid, self.gid)
        inode.created = time.monotonic()
        inode.mtime_ns = self.mount_time_ns
        self.inodes[ino] = inode
        self.by_key[key] = ino
        return inode

    def _detach(self, inode: Inode) -> None:
        """The key no longer names this inode; drop it once the kernel forgets it."""
        if self.by_key.get(inode.key) == inode.ino:
            del self.by_key[inode.key]
        inode.key = f"\0detached/{inode.ino}"  # never a valid S3 key
        if inode.lookups <= 0 and inode.ino != ROOT_INO:
            self.inodes.pop(inode.ino, None)

    def inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise NotFound(f"inode {ino}") from None

    def _dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if not inode.is_dir:
            raise NotADirectory(inode.key)
        return inode

    def _by_key(self, key: str) -> Inode | None:
        ino = self.by_key.get(key)
        return self.inodes.get(ino) if ino is not None else None

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        for ino, n in items:
            inode = self.inodes.get(ino)
            if inode is None or ino == ROOT_INO:
                continue
            inode.lookups -= n
            named = self.by_key.get(inode.key) == ino
            still_listed = named and self._listed_in_parent(inode)
            # A directory's listing is the metadata of its files (what S3 told us, HEADs
            # included): keep it when the kernel drops its dentries (memory pressure,
            # drop_caches), so the next pass over a dataset does not HEAD every file
            # again. Bounded by the inode count.
            kept = (named and inode.children is not None
                    and len(self.inodes) < MAX_KEPT_INODES)
            if inode.lookups > 0 or still_listed or kept:
                continue
            if any(h.inode is inode for h in self.handles.values()):
                continue  # an open handle still refers to it (fstat after unlink)
            if named:
                del self.by_key[inode.key]
            del self.inodes[ino]

    def _parent_of(self, key: str) -> Inode | None:
        """The inode of `key`'s directory, if we know one."""
        return self._by_key(parent_key(key))

    def _listed_in_parent(self, inode: Inode) -> bool:
        parent = self._parent_of(inode.key)
        return bool(parent and parent.children is not None
                    and parent.children.get(inode.key.rpartition("/")[2]) == inode.ino)

    def _key(self, parent: Inode, name: str) -> str:
        key = child_key(parent.key, name)
        if len(key.encode()) + 1 > MAX_KEY_BYTES:
            raise NameTooLong(name)
        return key

    def _fits(self, inode: Inode, size: int) -> None:
        """EFBIG beyond the largest object the part schedule can upload."""
        if size > self.max_file_size:
            raise FileTooBig(f"{inode.key}: {size} bytes is more than the "
                             f"{self.max_file_size} an object can have here")

    def _writable(self) -> None:
        if self.cfg.read_only:
            raise ReadOnly("mounted read-only")

    def _forget_child(self, inode: Inode) -> None:
        self._removed[inode.key] = time.monotonic()
        parent = self._parent_of(inode.key)
        if parent is not None and parent.children is not None:
            parent.children.pop(inode.key.rpartition("/")[2], None)
        self._detach(inode)

    def _add_child(self, parent: Inode, name: str, inode: Inode) -> None:
        if parent.children is not None:
            parent.children[name] = inode.ino
        parent.changed()

    # -- attributes -----------------------------------------------------------------------

    def _working_copy_of(self, inode: Inode) -> LocalFile | None:
        """This node's working copy of the file: by its key, or (unlinked while open)
        the one its open handles write."""
        if inode.is_dir:
            return None
        if not inode.detached:
            return self.local.by_key.get(inode.key)
        for h in self.handles.values():
            if h.inode is inode and h.lf is not None:
                return h.lf
        return None

    def attr(self, inode: Inode) -> Attr:
        nlink = 0 if inode.detached else self._dir_links(inode) if inode.is_dir else 1
        lf = self._working_copy_of(inode)
        if lf is not None:
            self.local.observe(lf)  # (written through passthrough: the size is the file's)
            timeout = 0.0 if inode.detached else self.ttl
            return Attr(inode.ino, lf.mode, lf.size, lf.uid, lf.gid, lf.mtime_ns, timeout,
                        nlink, lf.atime_ns, lf.ctime_ns)
        # Entries whose metadata only came from a LIST get no kernel caching, so that the
        # next stat asks us and we HEAD the object (its mode may even say symlink).
        timeout = (self.ttl if (inode.meta_loaded or inode.is_dir) and not inode.detached
                   else 0.0)
        return Attr(inode.ino, inode.mode, inode.size, inode.uid, inode.gid, inode.mtime_ns,
                    timeout, nlink, inode.atime_ns, inode.ctime_ns, inode.rdev)

    def _dir_links(self, d: Inode) -> int:
        """2 + the subdirectories we know of (as far as the directory was listed)."""
        if d.children is None:
            return 2
        subdirs = 0
        for ino in d.children.values():
            child = self.inodes.get(ino)
            subdirs += child is not None and child.is_dir
        return 2 + subdirs

    def ctrl_attr(self) -> Attr:
        return Attr(CTRL_INO, stat.S_IFREG | 0o666, 0, 0, 0, self.mount_time_ns, 0.0)

    def _show(self, inode: Inode, e: FileEntry | DirEntry) -> None:
        """Show the backend's entry `e` (of the inode's type) on `inode`."""
        if isinstance(e, FileEntry):
            old = inode.overlay
            if not isinstance(old, FileEntry) or old.content != e.content:
                inode.content_gen += 1
                inode.target = e.target
            inode.size = e.size
        inode.set_attrs(e.attrs)
        inode.meta_loaded = True
        inode.checked = time.monotonic()
        inode.overlay = e

    def _show_own(self, inode: Inode, e: FileEntry) -> None:
        """Our own change committed as `e`: the kernel's pages of it are current."""
        if not inode.detached:
            self._show(inode, e)
            inode.kernel_gen = inode.content_gen

    def _stored_in_s3(self, inode: Inode, ref: ObjectRef, attrs: Attrs | None) -> None:
        """S3 now holds the inode's content as `ref` (an upload, a metadata copy)."""
        if not inode.is_dir:
            inode.etag, inode.size = ref.etag, ref.size
            inode.modified = 0  # (a PUT's answer does not tell it)
        inode.in_s3 = True
        inode.overlay = None
        if attrs is not None:
            inode.set_attrs(attrs)
            inode.meta_loaded = True
        inode.checked = time.monotonic()

    def _inode_for(self, key: str, e: FileEntry | DirEntry | None, is_dir: bool) -> Inode:
        """The inode naming `key`, made or re-typed as needed, showing entry `e`."""
        inode = self._by_key(key)
        mode = (e.attrs.mode if e is not None else DEFAULT_DIR_MODE if is_dir
                else DEFAULT_FILE_MODE)
        if inode is None or stat.S_IFMT(inode.mode) != stat.S_IFMT(mode):
            inode = self._new_inode(key, mode)
        if e is not None:
            self._show(inode, e)
        return inode

    def _apply_info(self, inode: Inode, info: ObjectInfo, remember: bool = True) -> Inode:
        """Update a file inode from S3's view; returns the inode now naming the key (a new
        one if the object's type changed, so the kernel never sees an inode change type).
        `remember`: keep the metadata of a HEAD's answer for later LISTs of that version
        (not when it came from there)."""
        if remember and info.metadata is not None:
            self.meta.remember(info)
        modified = modified_s(info)
        if inode.etag is not None and inode.etag != info.etag and inode.backed is not None:
            # Passthrough opens read the old version's file and every open of an inode
            # shares one backing file: the name gets a new inode, they keep the old one.
            new = self._new_inode(inode.key, inode.mode)
            self._replace_child(new)
            inode = new
        elif inode.etag is not None and inode.etag != info.etag:
            if inode.lookups > 0:
                self.notify.attrs_now(inode.ino)  # (a new version: its size, its mtime)
            inode.content_gen += 1
            inode.meta_loaded = False
            inode.target = None
            self.router.drop_object(inode.key, keep_etag=info.etag)
        elif inode.modified and inode.modified != modified and info.metadata is None:
            inode.meta_loaded = False  # the same bytes, rewritten metadata: ask again
        if info.metadata is not None:
            a = parse_meta(info.metadata, DEFAULT_FILE_MODE, self.uid, self.gid,
                           info.mtime_ns)
            if stat.S_IFMT(a.mode) not in FILE_TYPES:
                a = replace(a, mode=DEFAULT_FILE_MODE | (a.mode & 0o7777), rdev=0)
            if stat.S_IFMT(a.mode) != stat.S_IFMT(inode.mode):
                new = self._new_inode(inode.key, a.mode)
                self._replace_child(new)
                inode = new
            inode.set_attrs(a)
            inode.meta_loaded = True
        elif not inode.meta_loaded:
            inode.mtime_ns = inode.atime_ns = inode.ctime_ns = info.mtime_ns
        inode.size = info.size
        inode.etag = info.etag
        inode.modified = modified
        inode.in_s3 = True
        inode.checked = time.monotonic()
        return inode

    def _replace_child(self, new: Inode) -> None:
        parent = self._parent_of(new.key)
        if parent is not None and parent.children is not None:
            parent.children[new.key.rpartition("/")[2]] = new.ino

    # -- what S3 says ---------------------------------------------------------------------

    async def _head(self, key: str) -> tuple[ObjectInfo | None, bool]:
        """(the object at `key`, whether `key/` is a directory), asked in parallel."""
        info: ObjectInfo | None = None
        is_dir = False

        async def obj() -> None:
            nonlocal info
            info = await self.store.head(key)

        async def prefix() -> None:
            nonlocal is_dir
            is_dir = await self.store.has_prefix(key + "/")

        with first_error():
            async with trio.open_nursery() as n:
                n.start_soon(obj)
                n.start_soon(prefix)
        return info, is_dir

    async def _revalidate_same(self, inode: Inode) -> Inode:
        """`_revalidate` for a request on this inode (a GETATTR, an OPEN): StaleObject if
        the name shows another inode now (another type, or a new version while passthrough
        opens keep this one), so the kernel looks the name up again."""
        fresh = await self._revalidate(inode)
        if fresh.ino != inode.ino:
            raise StaleObject(f"{inode.key}: another inode now")
        return fresh

    async def _revalidate(self, inode: Inode) -> Inode:
        """Bring a file inode up to date (its entry, or a HEAD coalesced with concurrent
        callers); NotFound if it is gone."""
        e = self.backend.entry(inode.key)
        if isinstance(e, FileEntry):
            self._show(inode, e)
            return inode
        inode.overlay = None
        key = inode.key
        asked = time.monotonic()
        while (ev := self._head_inflight.get(key)) is not None:
            await ev.wait()
            fresh = self._by_key(key)
            if fresh is None:
                raise NotFound(f"{key}: gone after another request's HEAD")
            if fresh.checked >= asked:
                return fresh  # answered while we waited
            inode = fresh  # that HEAD failed: ask ourselves (and say why if we fail too)
        ev = self._head_inflight[key] = trio.Event()
        try:
            info = await self._head_file(inode)
            if info is None:
                if self.by_key.get(key) == inode.ino and key not in self.local.by_key:
                    self._forget_child(inode)
                raise NotFound(f"{key}: no entry here and no object in S3 (HEAD)")
            inode = self._apply_info(inode, info)
        finally:
            del self._head_inflight[key]
            ev.set()
        fresh = self._by_key(key)
        if fresh is None:
            raise NotFound(f"{key}: gone after its HEAD")
        return fresh

    async def _head_batch(self, inodes: list[Inode]) -> None:
        """HEAD these file inodes in one store batch, as `_revalidate` would one by one
        (stats of them meanwhile wait for the batch's answer instead of asking again).
        A failed HEAD changes nothing: the stat that wants it asks again and says why."""
        waiting: dict[str, tuple[Inode, trio.Event]] = {}
        for inode in inodes:
            e = self.backend.entry(inode.key)
            if isinstance(e, FileEntry):
                self._show(inode, e)
            elif inode.key not in self._head_inflight:
                inode.overlay = None
                ev = self._head_inflight[inode.key] = trio.Event()
                waiting[inode.key] = (inode, ev)

        # Files being read are fetched whole, one GET each, as _head_file does.
        whole = [(k, inode.size) for k, (inode, _ev) in waiting.items()
                 if self._fetch_whole(inode)]
        fetched_whole = {k for k, _ in whole}
        heads = [k for k in waiting if k not in fetched_whole]

        def answered(key: str, info: ObjectInfo | None | Exception) -> None:
            inode, ev = waiting.pop(key)
            try:
                if info is None:
                    if self.by_key.get(key) == inode.ino and key not in self.local.by_key:
                        self._forget_child(inode)
                elif not isinstance(info, Exception):
                    self._apply_info(inode, info)
            finally:
                if self._head_inflight.get(key) is ev:
                    del self._head_inflight[key]
                ev.set()

        try:
            async with trio.open_nursery() as n:
                if whole:
                    n.start_soon(self.router.head_by_get_many, self.store, whole, answered)
                if heads:
                    n.start_soon(self.store.head_many, heads, answered)
        finally:
            for key, (_inode, ev) in waiting.items():
                if self._head_inflight.get(key) is ev:
                    del self._head_inflight[key]
                ev.set()

    def _fetch_whole(self, inode: Inode) -> bool:
        """Known only from a LIST, in a directory whose files are being read (not just
        stat'ed, like `ls -l`): a small one is fetched whole by the same request that
        tells its metadata."""
        parent = self._parent_of(inode.key)
        return (not inode.meta_loaded and inode.etag is not None and parent is not None
                and bool(parent.read_children)
                and self.router.fetches_whole(inode.key, inode.size, inode.etag))

    async def _head_file(self, inode: Inode) -> ObjectInfo | None:
        if self._fetch_whole(inode):
            return await self.router.head_by_get(self.store, inode.key, inode.size)
        return await self.store.head(inode.key)

    def _listed_file_stat(self, inode: Inode) -> None:
        """A file known only from its directory's LIST is being stat'ed (see
        META_PREFETCH_AFTER)."""
        parent = self._parent_of(inode.key)
        if parent is None or parent.children is None or self._background is None:
            return
        pf = self._meta_prefetching.get(parent.ino)
        if pf is not None:
            # A GETATTR moves the prefetch along as a LOOKUP does (after READDIRPLUS
            # the kernel may ask either): without it the window stopped growing and a
            # 10,000-entry `ls -l` on a WAN-like S3 went from 23 s to 95 s.
            pf.saw(inode.key.rpartition("/")[2])
            return
        sweep = self._sweeps.get(parent.ino)
        if sweep is None or sweep.children is not parent.children:
            if len(self._sweeps) >= MAX_SWEEPS:
                self._sweeps.clear()
            sweep = self._sweeps[parent.ino] = _Sweep(parent.children)
        name = inode.key.rpartition("/")[2]
        if sweep.saw(name) < META_PREFETCH_AFTER:
            return
        if self._prefetch_wasteful():
            return  # prefetching has mostly fetched what nobody asked for: not now
        del self._sweeps[parent.ino]
        pf = _MetaPrefetch(parent, name)
        self._meta_prefetching[parent.ino] = pf
        self._background.start_soon(self._prefetch_meta, pf)

    def _prefetch_wasteful(self) -> bool:
        """Whether prefetching lately fetched mostly what no stat asked for; for at most
        META_WASTE_PAUSE, then it is tried again."""
        if not (self._prefetched >= META_WASTE_MIN
                and self._prefetch_wasted > META_WASTE_SHARE * self._prefetched):
            self._prefetch_paused = None
            return False
        now = time.monotonic()
        if self._prefetch_paused is None:
            self._prefetch_paused = now
            log.info("metadata prefetch paused for %.0fs: %d of the last %d HEADs made ahead "
                     "of stats were not asked for", META_WASTE_PAUSE, self._prefetch_wasted,
                     self._prefetched)
        if now - self._prefetch_paused < META_WASTE_PAUSE:
            return True
        self._prefetched = self._prefetch_wasted = 0
        self._prefetch_paused = None
        return False

    async def _prefetch_meta(self, pf: _MetaPrefetch) -> None:
        d, children = pf.dir, pf.children

        async def worker() -> None:
            while pf.next < len(pf.names):
                if d.children is not children:
                    return  # listed again (or forgotten): the next stats start afresh
                # Far enough ahead of whoever is stat'ing: wait for them (or stop, when
                # they are done), so a few stats never fetch a whole directory. Files
                # being read are fetched whole (see _head_file): a shorter window.
                window = pf.window(bool(d.read_children))
                if pf.next > pf.cursor + window:
                    with trio.move_on_after(self.ttl) as waited:
                        await pf.moved.wait()
                    if waited.cancelled_caught:
                        return
                    continue  # (they moved, maybe not yet into reach: wait on)
                batch: list[Inode] = []
                while (pf.next < len(pf.names) and pf.next <= pf.cursor + window
                       and len(batch) < META_BATCH):
                    i = pf.next
                    pf.next += 1
                    inode = self.inodes.get(children.get(pf.names[i], -1))
                    if (inode is None or inode.is_dir or inode.meta_loaded
                            or inode.key in self.local.by_key
                            or inode.key in self._head_inflight):
                        continue
                    if i > pf.cursor:
                        pf.fetched.add(i)
                    batch.append(inode)
                if batch:
                    await self._head_batch(batch)

        try:
            async with trio.open_nursery() as n:
                for _ in range(META_PREFETCH):
                    n.start_soon(worker)
        except Exception:
            # Prefetching is an optimisation: its failure is a bug to log, not a reason
            # to take the mount down (the stats it was serving ask for themselves).
            log.exception("metadata prefetch in %r failed", d.key)
        finally:
            if self._meta_prefetching.get(d.ino) is pf:
                del self._meta_prefetching[d.ino]
            # Decayed tallies: what prefetching did lately decides whether it goes on.
            if self._prefetched > 16 * META_WASTE_MIN:
                self._prefetched //= 2
                self._prefetch_wasted //= 2
            self._prefetched += len(pf.fetched) + pf.used
            self._prefetch_wasted += len(pf.fetched)

    def _stat_seen(self, parent: Inode, name: str) -> None:
        """A lookup in `parent`: moves a running prefetch's window along."""
        pf = self._meta_prefetching.get(parent.ino)
        if pf is not None:
            pf.saw(name)

    def _fresh(self, t: float) -> bool:
        return time.monotonic() - t < self.ttl

    def _pending_child(self, key: str) -> Inode | None:
        """The inode for `key` if the backend has an entry for it (or below it)."""
        e = self.backend.entry(key)
        if isinstance(e, FileEntry):
            return self._inode_for(key, e, False)
        d = self.backend.entry(key + "/")
        if isinstance(d, DirEntry) or self.backend.live_under(key + "/"):
            return self._inode_for(key, d if isinstance(d, DirEntry) else None, True)
        return None

    async def _resolve(self, parent: Inode, name: str) -> Inode:
        """The child `name` of `parent`, asking S3 when our knowledge is stale."""
        key = self._key(parent, name)
        pending = self._pending_child(key)
        if pending is not None:
            if parent.children is not None:
                parent.children[name] = pending.ino
            return pending
        if self._meta_prefetching:
            self._stat_seen(parent, name)
        ino = parent.children.get(name) if parent.children is not None else None
        if ino is None:
            ino = self.by_key.get(key)
        inode = self.inodes.get(ino) if ino is not None else None
        if inode is not None and inode.overlay is not None:
            # It was an entry a moment ago (now written back, or gone): ask S3 afresh.
            inode.overlay = None
            inode.meta_loaded = False
            if inode.is_dir:
                self._forget_child(inode)
                inode = None
        if inode is not None:
            if inode.is_dir or key in self.local.by_key:
                return inode
            if inode.meta_loaded and self._fresh(inode.checked):
                return inode
            if inode.meta_loaded:
                # Many children of one directory going stale (the next epoch over a
                # dataset): one LIST page per 1000 of them confirms their ETags, instead
                # of a HEAD each. A few stale lookups still HEAD.
                parent.stale_lookups += 1
                if parent.stale_lookups >= RELIST_AFTER_STALE_LOOKUPS:
                    await self._relist(parent)
                    inode = self.inodes.get((parent.children or {}).get(name, -1)) or inode
                    if inode.meta_loaded and self._fresh(inode.checked):
                        return inode
            else:
                self._listed_file_stat(inode)
            return await self._revalidate(inode)
        if key in self.local.by_key:
            inode = self._new_inode(key, DEFAULT_FILE_MODE)
        elif parent.children is not None and self._fresh(parent.listed):
            raise NotFound(f"{key}: not in its directory's listing of "
                           f"{time.monotonic() - parent.listed:.1f}s ago")
        elif parent.stale_lookups >= RELIST_AFTER_STALE_LOOKUPS:
            # Many names looked up one by one in a directory nobody listed (a reader
            # opening its files by name): one LIST page per 1000 of them answers the rest
            # instead of a HEAD and a LIST each.
            await self._relist(parent)
            ino = (parent.children or {}).get(name)
            if ino is None or ino not in self.inodes:
                raise NotFound(f"{key}: not in its directory's listing")
            return self.inodes[ino]
        else:
            parent.stale_lookups += 1
            info, is_dir = await self._head(key)
            found = self._by_key(key)  # someone else may have created it meanwhile
            if found is not None:
                return found
            if is_dir:
                inode = self._new_inode(key, DEFAULT_DIR_MODE)
                inode.in_s3 = True
            elif info is not None:
                inode = self._apply_info(self._new_inode(key, DEFAULT_FILE_MODE), info)
            else:
                raise NotFound(f"{key}: no entry here and no object in S3 (HEAD)")
        if parent.children is not None:
            parent.children[name] = inode.ino
        return inode

    async def _relist(self, d: Inode) -> None:
        """List `d` again, once for all the lookups that are waiting on it."""
        ev = self._list_inflight.get(d.ino)
        if ev is not None:
            await ev.wait()
            return
        ev = self._list_inflight[d.ino] = trio.Event()
        try:
            if not self._fresh(d.listed):
                # A listing resets the directory's counts, but these lookups are readers
                # still at work: with its files no longer "being read", the next lookups
                # and the prefetch HEADed each small file that its open then GETs (a
                # full-suite run: 280 HEADs, 303 GETs and 18 LISTs for 300 files read
                # by 8 threads on a slow machine, where 16 + 8 HEADs is the bound).
                reading = d.read_children
                await self._list(d, force=True)
                d.read_children = max(d.read_children, reading)
        finally:
            del self._list_inflight[d.ino]
            ev.set()

    async def sync(self) -> bool:
        """Catch up with changes committed elsewhere before this call (a read barrier in a
        cluster); False if nothing can have changed (one node)."""
        changed = await self.backend.sync()
        self._apply_changes(self.backend.take_changes())
        return changed

    def lookup_now(self, parent_ino: int, name: bytes | str) -> Attr | None:
        """`lookup` of a child known here and fresh (no S3 request, no catch-up); None
        when `lookup` has to ask."""
        parent = self._dir(parent_ino)
        name = _name(name)
        if name == CTRL_NAME:
            return self.ctrl_attr()
        key = self._key(parent, name)
        if (self.backend.entry(key) is not None or self.backend.entry(key + "/") is not None
                or self.backend.live_under(key + "/")):
            return None  # (the namespace's entries: `_resolve` shows them)
        ino = parent.children.get(name) if parent.children is not None else None
        inode = self.inodes.get(ino if ino is not None else self.by_key.get(key, -1))
        if inode is None or inode.overlay is not None or not (
                inode.is_dir or key in self.local.by_key
                or (inode.meta_loaded and self._fresh(inode.checked))):
            return None
        if self._meta_prefetching:
            self._stat_seen(parent, name)
        inode.lookups += 1
        return self.attr(inode)

    async def lookup(self, parent_ino: int, name: bytes | str) -> Attr:
        parent = self._dir(parent_ino)
        name = _name(name)
        if name == CTRL_NAME:
            return self.ctrl_attr()
        try:
            inode = await self._resolve(parent, name)
        except NotFound:
            # Maybe another node created it an instant ago: catch up once.
            if not await self.sync():
                raise
            inode = await self._resolve(parent, name)
        inode.lookups += 1
        return self.attr(inode)

    def getattr_now(self, ino: int) -> Attr | None:
        """The attributes if they are known and fresh (no S3 request needed); None if
        `getattr` has to ask."""
        if ino == CTRL_INO:
            return self.ctrl_attr()
        inode = self.inode(ino)
        if inode.detached or inode.is_dir or inode.key in self.local.by_key or (
                inode.meta_loaded and self._fresh(inode.checked)):
            return None if inode.detached else self.attr(inode)
        return None

    async def getattr(self, ino: int) -> Attr:
        if ino == CTRL_INO:
            return self.ctrl_attr()
        inode = self.inode(ino)
        if inode.detached:
            if self._working_copy_of(inode) is None and not any(
                    h.inode is inode for h in self.handles.values()):
                # The kernel still shows a name it looked up before the name went to
                # another inode (replaced or removed by a commit applied here since, its
                # entry's invalidation on its way): ESTALE makes it look the name up again
                # (an open or a stat retries), where ENOENT failed an open of a file that
                # exists (the partition nemesis, seed 5404: a register read as missing).
                raise StaleObject(f"inode {inode.ino} was replaced or removed")
            return self.attr(inode)
        if (not inode.is_dir and inode.key not in self.local.by_key
                and not (inode.meta_loaded and self._fresh(inode.checked))):
            if not inode.meta_loaded:
                self._listed_file_stat(inode)
            inode = await self._revalidate_same(inode)
        return self.attr(inode)

    # -- directories ----------------------------------------------------------------------

    async def _list(self, d: Inode, force: bool = False, moves: int = 0) -> dict[str, int]:
        if d.children is not None and not force and self._fresh(d.listed):
            return d.children
        started = time.monotonic()
        prefix = f"{d.key}/" if d.key else ""
        # The namespace as it was before the LIST: a file whose write-back finished while
        # the LIST ran has left the namespace and may not be in the LIST either, and an
        # object deleted meanwhile may still be in it, with its tombstone gone.
        before = self.backend.view_under(prefix)
        arrived: dict[str, int] = {}
        self._arrived.setdefault(d.ino, []).append(arrived)
        try:
            children = await self._list_children(d, prefix, before, started)
        finally:
            mine = self._arrived[d.ino]
            mine.remove(arrived)
            if not mine:
                del self._arrived[d.ino]
        if d.detached:
            # Moved or removed by a change applied while the LIST ran (another node's
            # rename detaches the directory here): what was listed under its old name is
            # not its content, and an empty listing of it was shown (a clean-clone CI
            # run: `ls y` empty while another node renamed y back and forth).
            raise NotFound(f"directory {prefix!r} was moved or removed while it was listed")
        if d.key != prefix.rstrip("/"):  # renamed here meanwhile: list it where it is now
            if moves >= MAX_LIST_MOVES:
                raise NotFound(f"directory {d.key!r} kept moving while it was listed")
            return await self._list(d, force=True, moves=moves + 1)
        for name, ino in arrived.items():
            children.setdefault(name, ino)
        for name, ino in (d.children or {}).items():
            inode = self.inodes.get(ino)
            if name not in children and inode is not None and inode.created >= started:
                children[name] = ino
        for name in [n for n, ino in children.items()
                     if ino not in self.inodes or self.inodes[ino].detached]:
            del children[name]  # removed (by a change applied) while the listing ran
        if d.children is not None:
            for name, ino in d.children.items():
                if name not in children and ino in self.inodes:
                    inode = self.inodes[ino]
                    if inode.key == prefix + name:
                        self._detach(inode)
        d.children = children
        d.listed = time.monotonic()
        d.stale_lookups = d.read_children = 0
        return children

    async def _list_children(self, d: Inode, prefix: str, before: NsView, started: float
                             ) -> dict[str, int]:
        """S3's listing of `d`, merged with what the namespace holds (see `_list`)."""
        found: dict[str, ObjectInfo | None] = {}
        hidden_listed: list[str] = []
        async for page in self.store.list_dir(prefix):
            for o in page.objects:
                name = o.key[len(prefix):]
                if not name:
                    d.in_s3 = True  # the directory's own marker
                elif o.key in before.hidden:
                    hidden_listed.append(o.key)
                elif _valid_listed(name) and name not in found:
                    found[name] = o
            for p in page.prefixes:
                name = p[len(prefix):-1]
                if _valid_listed(name):
                    found[name] = None  # a directory wins over a same-named object
        known = await self._known_meta(found)
        children: dict[str, int] = {}
        for name, info in found.items():
            key = prefix + name
            inode = self._by_key(key)
            if info is None:
                if inode is None or not inode.is_dir:
                    inode = self._new_inode(key, DEFAULT_DIR_MODE)
                inode.in_s3 = True
            else:
                if inode is None or inode.is_dir:
                    inode = self._new_inode(key, DEFAULT_FILE_MODE)
                meta = known.get(key)
                inode = self._apply_info(inode, info if meta is None else
                                         replace(info, metadata=meta), remember=False)
            children[name] = inode.ino
        now = self.backend.view_under(prefix)
        self._merge_unlisted(d, children, now)
        listed = {prefix + name for name in found} | set(hidden_listed)
        await self._changed_while_listing(d, children, before, now, listed, started)
        return children

    async def _known_meta(self, found: dict[str, ObjectInfo | None]
                          ) -> dict[str, dict[str, str]]:
        """The metadata already known (here, or in the cluster) of the listed versions
        whose inodes lack it: what spares `ls -l` a HEAD per file."""
        want = []
        for info in found.values():
            if info is None:
                continue
            inode = self._by_key(info.key)
            if (inode is None or not inode.meta_loaded or inode.etag != info.etag
                    or inode.is_dir or inode.modified not in (0, modified_s(info))):
                want.append(info)
        if not want:
            return {}
        return await self.meta.lookup(want)

    async def _changed_while_listing(self, d: Inode, children: dict[str, int],
                                     before: NsView, now: NsView, listed: set[str],
                                     started: float) -> None:
        """Settle, with a HEAD each, the few keys whose state changed while the LIST ran
        and that the listing may therefore show wrongly: entries that left the namespace
        (uploaded, or removed), listed objects whose tombstone went (deleted from S3, or
        written again) and listed names removed here meanwhile."""
        prefix = f"{d.key}/" if d.key else ""
        settled = {k for k, _ in now.live} | now.hidden
        doubtful = {k for k, _ in before.live if k not in settled}
        doubtful |= {k for k in listed if k not in settled
                     and (k in before.hidden or self._removed.get(k, -1.0) >= started)}
        if len(self._removed) > 1024:
            old = time.monotonic() - REMOVED_MEMORY
            self._removed = {k: t for k, t in self._removed.items() if t >= old}
        for key in sorted(doubtful):
            name, sep, _ = key[len(prefix):].partition("/")
            k = prefix + name
            if not _valid_listed(name) or k in self.local.by_key:
                continue
            if name in children and k not in listed:
                continue  # the namespace shows it
            children.pop(name, None)
            if not sep and (info := await self.store.head(k)) is not None:
                inode = self._by_key(k)
                if inode is None or inode.is_dir:
                    inode = self._new_inode(k, DEFAULT_FILE_MODE)
                children[name] = self._apply_info(inode, info).ino
            elif await self.store.has_prefix(k + "/"):
                inode = self._by_key(k)
                if inode is None or not inode.is_dir:
                    inode = self._new_inode(k, DEFAULT_DIR_MODE)
                inode.in_s3 = True
                children[name] = inode.ino
            elif (inode := self._by_key(k)) is not None:
                self._forget_child(inode)  # what the LIST said of it is gone

    def _merge_unlisted(self, d: Inode, children: dict[str, int], view: NsView) -> None:
        """Add to a fresh listing what S3 does not show yet: working copies on this node
        and the backend's entries."""
        for key in self.local.by_key:
            if parent_key(key) == d.key and key.rpartition("/")[2] not in children:
                inode = self._by_key(key) or self._new_inode(key, DEFAULT_FILE_MODE)
                children[key.rpartition("/")[2]] = inode.ino
        prefix = f"{d.key}/" if d.key else ""
        for k, e in view.live:
            rest = k[len(prefix):]
            if not rest:
                continue
            name, sep, _ = rest.partition("/")
            if not _valid_listed(name):
                continue
            key = prefix + name
            if sep:
                exact = e if rest == name + "/" and isinstance(e, DirEntry) else None
                inode = self.inodes.get(children.get(name, -1))
                if inode is None or not inode.is_dir or exact is not None:
                    inode = self._inode_for(key, exact, True)
            else:
                assert isinstance(e, FileEntry)
                inode = self._inode_for(key, e, False)
            children[name] = inode.ino

    async def opendir(self, ino: int) -> tuple[list[tuple[str, int, int]], bool]:
        """A snapshot of the directory's (name, inode, mode), sorted by name (the handle
        pages through it), and whether it is the listing the kernel was given last time:
        the kernel then keeps the listing it cached and reads none of it from us."""
        d = self._dir(ino)
        await self.sync()  # a listing shows every change committed before it
        if d.detached:
            # Renamed or removed (on another node) before this listing: not an empty
            # directory, no directory at all.
            raise NotFound(f"directory inode {ino} was moved or removed")
        children = await self._list(d)
        shown = hash(frozenset(children.items()))
        same = d.kernel_listing == shown
        d.kernel_listing = shown
        out = []
        for name in sorted(children):
            inode = self.inodes.get(children[name])
            if inode is not None:
                out.append((name, inode.ino, inode.mode))
        return out, same

    def listed_attr(self, ino: int) -> Attr | None:
        """The attributes of an inode a listing named (None: gone since)."""
        inode = self.inodes.get(ino)
        return self.attr(inode) if inode is not None else None

    async def readdir(self, ino: int) -> list[tuple[str, Attr]]:
        """The directory's entries with their attributes, sorted by name."""
        entries, _ = await self.opendir(ino)
        return [(name, a) for name, i, _ in entries if (a := self.listed_attr(i)) is not None]

    def note_lookup(self, ino: int) -> None:
        """readdirplus handed the kernel an entry: that counts as a lookup."""
        inode = self.inodes.get(ino)
        if inode is not None:
            inode.lookups += 1

    async def _free_name(self, parent_ino: int, name: bytes | str) -> tuple[Inode, str, str]:
        """(parent, name, key) for a new entry; EEXIST if the name is taken."""
        self._writable()
        parent = self._dir(parent_ino)
        name = _name(name)
        key = self._key(parent, name)
        try:
            await self._resolve(parent, name)
        except NotFound:
            return parent, name, key
        raise Exists(name)

    async def mkdir(self, parent_ino: int, name: bytes | str, mode: int, uid: int,
                    gid: int) -> Attr:
        parent, name, key = await self._free_name(parent_ino, name)
        now = time.time_ns()
        attrs = Attrs(stat.S_IFDIR | (mode & 0o7777), uid, gid, now, now, now)
        e = await self.backend.mkdir(key, attrs)
        inode = self._inode_for(key, e, True)
        inode.set_attrs(attrs)
        inode.in_s3 = e is None
        inode.children = {}
        inode.listed = time.monotonic()
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    async def _empty_dir(self, parent_ino: int, name: bytes | str) -> tuple[Inode, Inode]:
        """rmdir's checks: (the parent, the directory named), which must be empty."""
        self._writable()
        parent = self._dir(parent_ino)
        inode = await self._resolve(parent, _name(name))
        if not inode.is_dir:
            raise NotADirectory(inode.key)
        if await self._list(inode, force=True):
            raise NotEmpty(inode.key)
        return parent, inode

    async def rmdir(self, parent_ino: int, name: bytes | str) -> None:
        parent, inode = await self._empty_dir(parent_ino, name)
        await self.backend.rmdir(inode.key, inode.in_s3)
        self._forget_child(inode)
        parent.changed()

    # -- files ----------------------------------------------------------------------------

    def _new_handle(self, fh: FileHandle) -> int:
        n = self._next_fh
        self._next_fh += 1
        self.handles[n] = fh
        return n

    def handle(self, fh: int) -> FileHandle:
        try:
            return self.handles[fh]
        except KeyError:
            raise Invalid(f"bad file handle {fh}") from None

    def _source(self, inode: Inode) -> Source:
        """Where the inode's current content is read from (see objcache.core.handles)."""
        e = inode.overlay
        if isinstance(e, FileEntry):
            if e.cid:
                return BlobSource(self.backend, e, inode, self.router)
            if e.base and e.size:
                return ObjectSource(self.router, ObjectRef(e.base.key, e.base.etag,
                                                           min(e.size, e.base.size)),
                                    self.readahead_chunks)
            return EMPTY
        if inode.etag is None:
            return EMPTY
        return ObjectSource(self.router, ObjectRef(inode.key, inode.etag, inode.size),
                            self.readahead_chunks)

    async def _working_copy(self, inode: Inode, empty: bool = False) -> LocalFile:
        """The working copy of `inode` on this node, made if needed from its current
        content (none of it if `empty`): S3 versions lazily (chunks are copied as they
        are written), a blob whole. Concurrent callers (the kernel sends the pages of a
        shared mmap as parallel writes) wait for the one copy being made: a write into a
        copy still being filled would be overwritten by the fill."""
        key = inode.key
        while (making := self._making.get(key)) is not None:
            await making.wait()
        lf = self._working_copy_of(inode)
        if lf is not None:
            return lf
        self._making[key] = done = trio.Event()
        try:
            return await self._new_working_copy(inode, empty)
        finally:
            del self._making[key]
            done.set()

    async def _new_working_copy(self, inode: Inode, empty: bool) -> LocalFile:
        e = inode.overlay
        if isinstance(e, FileEntry):
            a = e.attrs
            if e.base and not empty:
                return self.local.create(inode.key, a,
                                         base=(e.base.key, e.base.etag, e.base.size))
            lf = self.local.create(inode.key, a)
            if e.cid and e.size and not empty:
                entry = e

                async def piece(off: int, n: int) -> bytes:
                    return await self.backend.read_blob(entry, off, n)

                await self.local.fill(lf, e.size, piece)
            return lf
        base = None
        if inode.in_s3 and inode.size > 0 and inode.etag and not empty:
            base = (inode.key, inode.etag, inode.size)
        return self.local.create(inode.key, inode.attrs, base=base,
                                 etag=inode.etag if inode.in_s3 else None)

    def _opening(self, ino: int, flags: int) -> tuple[Inode, bool]:
        """open's checks before the catch-up: (the inode, whether it opens for writing)."""
        inode = self.inode(ino)
        if inode.is_dir:
            raise IsADirectory(inode.key)
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if writable:
            self._writable()
        return inode, writable

    def _caught_up(self, inode: Inode) -> LocalFile | None:
        """open's checks after the catch-up; the working copy here, if any."""
        lf = self._working_copy_of(inode) if inode.detached else None
        if inode.detached and (lf is None or lf.aside):
            # The name now shows another inode (replaced or removed meanwhile, maybe by
            # the catch-up just before, after the kernel looked the name up): ESTALE makes
            # the kernel look it up again and open what the name shows now. A working
            # copy set aside is an older version that handles here still have open (the
            # inode left the name for another node's commit): not what an open may read.
            raise StaleObject(f"inode {inode.ino} was replaced or removed")
        parent = self._parent_of(inode.key)
        if parent is not None:
            parent.read_children += 1  # see _head_file (a revalidation GETs it whole)
        e = self.backend.entry(inode.key)
        if isinstance(e, FileEntry):
            self._show(inode, e)
        return self.local.by_key.get(inode.key)

    def _stale_for_open(self, inode: Inode, lf: LocalFile | None) -> bool:
        """Written back or removed since we showed an entry, or stale: close-to-open
        against S3 (a HEAD), so an open after the TTL sees a changed object."""
        return (lf is None and not isinstance(self.backend.entry(inode.key), FileEntry)
                and (inode.overlay is not None
                     or not (inode.meta_loaded and self._fresh(inode.checked))))

    def _landing(self, inode: Inode, lf: LocalFile | None, source: Source) -> bool:
        """Whether the object's last chunks may be on their way to the cache disk (a read
        just now): worth a moment's wait, for a passthrough open instead of the daemon's."""
        return (isinstance(source, ObjectSource) and lf is None and inode.backed is None
                and not inode.daemon_opens and self.passthrough.available
                and self.router.landing(source.ref.key, source.ref.etag, source.ref.size))

    def open_now(self, ino: int, flags: int) -> tuple[int, bool, int] | None:
        """`open` when it needs no wait: one node (no catch-up), a fresh clean file or a
        working copy here, no O_TRUNC; None when `open` has to."""
        if not self.backend.sync_is_local:
            return None
        inode, writable = self._opening(ino, flags)
        self._apply_changes(self.backend.take_changes())
        lf = self._caught_up(inode)
        if self._stale_for_open(inode, lf) or (writable and flags & os.O_TRUNC) or (
                writable and lf is not None and (lf.shared or lf.linked is not None)):
            return None
        source = self._source(inode)
        if self._landing(inode, lf, source):
            return None
        return self._opened(inode, writable, source, lf, mappable=_mappable(flags))

    async def open(self, ino: int, flags: int) -> tuple[int, bool, int]:
        """Returns (file handle, whether the kernel may keep its cached pages, the
        passthrough backing id or 0)."""
        inode, writable = self._opening(ino, flags)
        await self.sync()  # close-to-open: every close committed anywhere before this
        # An invalidation of this inode still on its way (a change the barrier just
        # applied) would land while the kernel asks for the new size after our answer:
        # the kernel drops an attribute answer that an invalidation overtook, and read
        # the old size (0 bytes of a file just closed elsewhere: a close-to-open
        # violation at 32 nodes).
        await self.notify.inode_settled(inode.ino)
        lf = self._caught_up(inode)
        if self._stale_for_open(inode, lf):
            await self._revalidate_same(inode)
            lf = self.local.by_key.get(inode.key)
        if writable:
            lf = self._writer_copy(inode, lf)
        if writable and flags & os.O_TRUNC and lf is None:
            lf = await self._working_copy(inode, empty=True)
        if not writable or lf is None:
            source = self._source(inode)
            if self._landing(inode, lf, source):
                ref = source.ref  # type: ignore[attr-defined]
                await self.router.landed(ref.key, ref.etag, ref.size, LANDING_PATIENCE)
            return self._opened(inode, writable, source, lf, mappable=_mappable(flags))
        # Open (and a writer) from here on, before it waits below (the copy that unshares
        # a sealed blob):
        # - a working copy nobody had open could be dropped meanwhile (the RELEASE of the
        #   previous handle, another node's commit of the key, an eviction) and its data
        #   file deleted: the open answered EIO (FileNotFoundError; the partition
        #   nemesis, on a healthy cluster). An open one is set aside instead, and this
        #   handle keeps it;
        # - the RELEASE of the previous handle leaves what this open truncates to this
        #   handle's close (`release`).
        was_dirty = lf.dirty
        self.local.opened(lf, True)
        try:
            if flags & os.O_TRUNC:
                # O_TRUNC changes the file (and its mtime) even when it is empty already.
                await self.local.truncate(lf, 0)
            # A sealed blob sharing the working copy's file gets its own before a writer
            # may write the file (without us, through passthrough).
            await self.local.unshare(lf)
            return self._opened(inode, True, self._source(inode), lf, counted=True,
                                mappable=_mappable(flags))
        except BaseException:
            self._uncount(lf, True)
            if not was_dirty and lf.dirty and lf.opens == 0 and not lf.removed:
                # The open failed after its truncate: nobody will close (and commit) it.
                # Left here, the truncated copy was what this node showed: a read of it
                # returned an empty file nobody wrote (the partition nemesis, 5 nodes).
                # What was committed before stays the file's content.
                self.local.remove(lf)
            raise

    def _writer_copy(self, inode: Inode, lf: LocalFile | None) -> LocalFile | None:
        """The working copy a writer opening `inode` writes: while the inode's open
        handles are passed through, the kernel's backing file of it (one per inode; a
        cached object version becomes the working copy, `_hand_over`), else `lf`.
        StaleObject, before anything is changed, when the backing file cannot be one."""
        b = inode.backed
        if b is None:
            return lf
        if b.lf is None and b.obj is not None:
            self._hand_over(inode, b)
        if b.lf is None:
            # (its version left the cache while read: reopening gets the current one)
            raise StaleObject(f"{inode.key}: changed while open; open it again")
        return b.lf

    def _uncount(self, lf: LocalFile, writable: bool) -> None:
        """An open that counted `lf` failed: as if its handle were released."""
        self.local.closed(lf, writable)
        if lf.opens == 0:
            self.backend.released(lf)

    def _opened(self, inode: Inode, writable: bool, source: Source,
                lf: LocalFile | None, counted: bool = False, mappable: bool = False
                ) -> tuple[int, bool, int]:
        """`counted`: `lf` is counted as open already (by `open`)."""
        fh = FileHandle(inode, writable, source, lf, mappable=mappable)
        if lf is not None and not counted:
            self.local.opened(lf, writable)
        try:
            backing_id = self._pass_through(fh)
        except BaseException:
            if lf is not None and not counted:
                self._uncount(lf, writable)
            raise
        keep = inode.kernel_gen == inode.content_gen
        if not keep:
            self.notify.attrs_now(inode.ino)  # the kernel's size may be an old version's
        inode.kernel_gen = inode.content_gen
        return self._new_handle(fh), keep, backing_id

    # -- passthrough ------------------------------------------------------------------------

    def _pass_through(self, h: FileHandle) -> int:
        """The backing id the kernel serves this new handle from, or 0: the daemon serves
        it (see objcache.core.passthrough for the kernel's rules)."""
        inode = h.inode
        b = inode.backed
        if b is None:
            found = None
            if self.passthrough.available and not inode.daemon_opens:
                found = self._backing_file(h)
            b = self.passthrough.register(found[0]) if found is not None else None
            if b is None:
                inode.daemon_opens += 1
                self.passthrough.daemon_opens += 1
                return 0
            b.lf = found[1]
            if found[2] is not None:
                b.obj = self.router.cache.hold(*found[2])
            inode.backed = b
        if h.writable:
            lf = self._writer_copy(inode, h.lf)
            if h.lf is not None and h.lf is not lf:
                # (the handles open here have another version's file, taken while `open`
                # waited: reopening gets the current version)
                raise StaleObject(f"{inode.key}: changed while open; open it again")
            if h.lf is None:
                h.lf = b.lf  # its writes go there, by the kernel
                self.local.opened(b.lf, True)
            self.local.bypass_opened(b.lf, h.mappable)
        b.opens += 1
        h.backed = True
        self.passthrough.opens += 1
        return b.id

    def _backing_file(self, h: FileHandle
                      ) -> tuple[str, LocalFile | None, tuple[str, str] | None] | None:
        """The file that holds all of the inode's bytes on this node, if one does: a
        working copy, or a cached object version (path, working copy, (key, etag))."""
        inode = h.inode
        if h.writable and self.router.cache.headroom() < writer_headroom(
                self.router.cache.capacity):
            return None  # (too little room to let a writer run ahead of the budget)
        lf = h.lf or self._working_copy_of(inode)
        if lf is not None:
            if lf.removed or lf.base_limit or lf.shared:
                return None  # partly an S3 version still, or a sealed blob now
            return lf.path, lf, None
        src = h.source
        if not isinstance(src, ObjectSource) or inode.detached:
            return None
        ref = src.ref
        if h.writable and ref.key != inode.key:
            return None  # (a renamed file still reading its old key's object)
        path = self.router.whole_file(ref.key, ref.etag, ref.size)
        return (path, None, (ref.key, ref.etag)) if path is not None else None

    def _hand_over(self, inode: Inode, b: Backed) -> None:
        """A writer opens a file whose backing file is a cached object version: that file
        becomes its working copy, in place (the kernel keeps serving every open of the
        inode from it)."""
        assert b.obj is not None
        if not self.router.cache.holds_file(b.obj):
            return
        etag = b.obj.etag
        path = self.router.cache.hand_over(b.obj)
        b.lf = self.local.adopt(inode.key, inode.attrs, path, inode.size, etag)
        b.obj = None
        for other in self.handles.values():
            if other.inode is inode and other.lf is None:
                other.lf = b.lf  # open on it already: it is not evicted under them
                self.local.opened(b.lf, False)

    def _unback(self, h: FileHandle) -> None:
        """A handle is released: its share of the backing file, or of the daemon's opens."""
        inode = h.inode
        if not h.backed:
            inode.daemon_opens -= 1
            return
        b = inode.backed
        assert b is not None
        b.opens -= 1
        if b.opens == 0:
            inode.backed = None
            if b.obj is not None:
                self.router.cache.unhold(b.obj)
            self.passthrough.release(b)

    def flushes(self, fh: int) -> bool:
        """Whether a close(2) of this handle may have anything to make durable: not a
        read-only one of a file with no working copy here."""
        h = self.handle(fh)
        return h.writable or h.lf is not None

    async def create(self, parent_ino: int, name: bytes | str, mode: int, flags: int,
                     uid: int, gid: int) -> tuple[int, Attr, int]:
        self._writable()
        parent = self._dir(parent_ino)
        name = _name(name)
        key = self._key(parent, name)
        now = time.time_ns()
        attrs = Attrs(stat.S_IFREG | (mode & 0o7777), uid, gid, now, now, now)
        e = await self.backend.create(key, attrs, excl=bool(flags & os.O_EXCL))
        old = self.local.by_key.get(key)
        if old is not None:
            self.local.remove(old)
        lf = self.local.create(key, attrs)
        if e is None:
            self.local.mark_dirty(lf)  # the working copy is the only record: it must upload
        inode = self._inode_for(key, e, False)
        if inode.backed is not None or inode.daemon_opens:
            # Created anew under a name whose old file is still open here (a race with
            # another node's create): the open handles keep that inode.
            inode = self._new_inode(key, attrs.mode)
            if e is not None:
                self._show(inode, e)
        inode.set_attrs(attrs)
        inode.meta_loaded = True
        inode.lookups += 1
        inode.kernel_gen = inode.content_gen
        self._add_child(parent, name, inode)
        self.local.opened(lf, True)
        h = FileHandle(inode, True, EMPTY, lf, mappable=_mappable(flags))
        backing_id = self._pass_through(h)
        fh = self._new_handle(h)
        return fh, self.attr(inode), backing_id

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Bytes at `offset` of an open file, to be used before the caller next awaits
        (they may be a view of a reused buffer; a FUSE reply is sent at once)."""
        h = self.handle(fh)
        lf = h.lf or self._working_copy_of(h.inode)  # written on this node: read that
        if lf is not None:
            data = await self.local.read(lf, offset, size)
        else:
            data = await h.source.read(offset, size)
        self.passthrough.read_bytes += len(data)
        return data

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self.handle(fh)
        if not h.writable:
            raise Invalid("handle not open for writing")
        self._fits(h.inode, offset + len(data))
        if h.lf is None:
            h.lf = await self._working_copy(h.inode)
            self.local.opened(h.lf, True)
        self.passthrough.written_bytes += len(data)
        return await self.local.write(h.lf, offset, data)

    async def flush(self, fh: int) -> None:
        """close(): what the handle wrote becomes durable (the close-to-open point)."""
        h = self.handle(fh)
        if h.backed and h.lf is not None:
            self.local.observe(h.lf)
        if h.lf is not None and h.lf.dirty and not h.lf.removed:
            await self._close(h.inode, h.lf, final=self._last_writer(h))

    async def _close(self, inode: Inode, lf: LocalFile, *, final: bool) -> None:
        """Make what `lf` holds the file's content (the backend's close). A cluster close
        that fails to commit (NoQuorum, InDoubt) withdraws the working copy: the kernel's
        pages of it are dropped, and the inode shows what the log has."""
        try:
            e = await self.backend.close(inode.key, lf, final=final)
        except NoQuorum:
            if not inode.detached:
                inode.content_gen += 1
                self.notify.inode(inode.ino)
            raise
        if e is not None:
            self._show_committed(inode, lf, e)

    def _show_committed(self, inode: Inode, lf: LocalFile, e: FileEntry) -> None:
        """Our close committed `e`. Another node's commit of the key may have come after
        it in the log and been applied while the close returned (skipped then: `lf` was
        still dirty): then the inode shows that newer entry and `lf` is set aside, or
        this node went on showing its own older bytes (the partition nemesis: one node
        disagreed with the others and S3 for good)."""
        cur = self.backend.entry(inode.key)
        if (isinstance(cur, FileEntry) and cur.ver > e.ver and not inode.detached
                and cur.content != e.content):
            if not lf.dirty and not lf.removed:
                if lf.opens == 0:
                    self.local.remove(lf)
                else:
                    self.local.set_aside(lf)
            self._show(inode, cur)
            self.notify.inode(inode.ino)
            return
        self._show_own(inode, e)

    @staticmethod
    def _last_writer(h: FileHandle) -> bool:
        """Whether no other handle open for writing shares `h`'s working copy."""
        assert h.lf is not None
        return h.lf.writers - int(h.writable) == 0

    async def fsync(self, fh: int) -> None:
        h = self.handle(fh)
        lf = h.lf or self._working_copy_of(h.inode)
        if lf is not None:
            self.local.observe(lf)
        if lf is None or not lf.dirty or lf.removed:
            return
        try:
            got = await self.backend.fsync(h.inode.key, lf)
        except NoQuorum:
            if not h.inode.detached:  # withdrawn, as at a failed close (`_close`)
                h.inode.content_gen += 1
                self.notify.inode(h.inode.ino)
            raise
        if isinstance(got, FileEntry):
            self._show_own(h.inode, got)
        elif isinstance(got, ObjectRef) and not h.inode.detached:
            self._stored_in_s3(h.inode, got, lf.attrs)

    def release_now(self, fh: int) -> bool:
        """Release a handle with nothing to make durable at once; False if `release`
        has to (a working copy: it may have to be committed)."""
        h = self.handles.get(fh)
        if h is not None and h.lf is not None:
            return False
        if h is not None:
            del self.handles[fh]
            self._unback(h)
        return True

    async def release(self, fh: int) -> None:
        if self.release_now(fh):
            return
        h = self.handles.pop(fh)
        self._unback(h)
        lf = h.lf
        if h.backed and h.writable:
            self.local.bypass_closed(lf)
        if h.writable and lf.dirty and not lf.removed and self._last_writer(h):
            # Written after the last flush (a dup'ed descriptor, mmap write-back). Not
            # while another handle may write it: what that one did is its close's to
            # commit, or to withdraw should it fail (the RELEASE that follows a close(2)
            # came after the next open(O_TRUNC) and committed its truncation: an empty
            # file, for good when that writer's close then failed; the partition nemesis).
            try:
                await self._close(h.inode, lf, final=self._last_writer(h))
            except ObjcacheError as ex:
                log.error("could not make %r durable at its last close: %s", lf.key, ex)
        self.local.closed(lf, h.writable)
        if lf.opens == 0:
            self.backend.released(lf)
        if h.inode.detached and h.inode.lookups <= 0 and not any(
                x.inode is h.inode for x in self.handles.values()):
            self.inodes.pop(h.inode.ino, None)

    async def setattr(self, ino: int, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None, fh: int | None = None,
                      atime_ns: int | None = None) -> Attr:
        if ino == CTRL_INO:
            return self.ctrl_attr()
        self._writable()
        inode = self.inode(ino)
        if inode.is_dir:
            if size is not None:
                raise IsADirectory(inode.key)
            new = _new_attrs(inode.attrs, mode, uid, gid, mtime_ns, atime_ns)
            if new != inode.attrs:
                e = await self.backend.set_dir_attrs(inode.key, new) if inode.key else None
                if e is not None:
                    self._show(inode, e)
                inode.set_attrs(new)
                inode.meta_loaded = True
                inode.checked = time.monotonic()
            return self.attr(inode)
        h = self.handles.get(fh) if fh is not None else None
        lf = (h.lf if h is not None else None) or self._working_copy_of(inode)
        if size is not None:
            if lf is None:
                if inode.detached:
                    raise NotFound(f"{inode.key}: removed before it was written here")
                lf = await self._working_copy(inode)
            if h is not None and h.writable and h.lf is None:
                h.lf = lf  # ftruncate: what it did is committed at the handle's close
                self.local.opened(lf, True)
            self._fits(inode, size)
            await self.local.truncate(lf, size)  # mtime = now (POSIX: a size change)
        if lf is not None:
            cur = lf.attrs
            new = _new_attrs(cur, mode, uid, gid, mtime_ns, atime_ns)
            if new != cur:
                lf.set_attrs(new)
                ref = await self.backend.working_attrs_changed(lf)
                if ref is not None and not inode.detached:
                    if inode.etag and ref.etag != inode.etag:
                        self.router.rekey(inode.key, inode.etag, inode.key, ref.etag)
                    self._stored_in_s3(inode, ref, new)
            if lf.opens == 0 and not lf.removed:
                # truncate(2)/chmod(2) on a path: as if opened, changed and closed.
                if lf.dirty:
                    await self._close(inode, lf, final=lf.writers == 0)
                self.backend.released(lf)
            return self.attr(inode)
        new = _new_attrs(inode.attrs, mode, uid, gid, mtime_ns, atime_ns)
        if new == inode.attrs:
            return self.attr(inode)
        current = inode.overlay
        if not isinstance(current, FileEntry):
            if not inode.etag:
                inode = await self._revalidate(inode)
            current = ObjectRef(inode.key, inode.etag or "", inode.size)
        got = await self.backend.set_file_attrs(inode.key, current, new)
        if isinstance(got, FileEntry):
            self._show(inode, got)
        else:
            if inode.etag and got.etag != inode.etag:
                self.router.rekey(inode.key, inode.etag, inode.key, got.etag)
            self._stored_in_s3(inode, got, new)
        return self.attr(inode)

    async def unlink(self, parent_ino: int, name: bytes | str) -> None:
        self._writable()
        parent = self._dir(parent_ino)
        inode = await self._resolve(parent, _name(name))
        if inode.is_dir:
            raise IsADirectory(inode.key)
        key = inode.key
        lf = self.local.by_key.get(key)
        async with AsyncExitStack() as stack:
            if lf is not None:
                await stack.enter_async_context(lf.lock)  # never while it is uploading
            await self.backend.unlink(key, inode.in_s3 or (lf is not None
                                                           and lf.etag is not None))
            if lf is not None:
                self.local.remove(lf)  # its data stays while a handle has it open
        self.router.drop_object(key)
        self._forget_child(inode)
        parent.changed()

    async def symlink(self, parent_ino: int, name: bytes | str, target: bytes, uid: int,
                      gid: int) -> Attr:
        now = time.time_ns()
        return await self._make_node(parent_ino, name, Attrs(SYMLINK_MODE, uid, gid, now,
                                                             now, now), bytes(target))

    async def mknod(self, parent_ino: int, name: bytes | str, mode: int, rdev: int,
                    uid: int, gid: int) -> Attr:
        """A FIFO, socket or device: an empty object whose mode says its type (s3fs-fuse's
        convention); a regular file: an empty file."""
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind == stat.S_IFREG:
            fh, attr, _ = await self.create(parent_ino, name, mode & 0o7777,
                                            os.O_WRONLY | os.O_EXCL, uid, gid)
            try:
                await self.flush(fh)
            finally:
                await self.release(fh)
            return attr
        if kind not in SPECIAL_TYPES:
            raise Invalid(f"mknod of file type {kind:o}")
        now = time.time_ns()
        dev = rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0
        return await self._make_node(parent_ino, name, Attrs(
            kind | (mode & 0o7777), uid, gid, now, now, now, dev), b"")

    async def _make_node(self, parent_ino: int, name: bytes | str, attrs: Attrs,
                         body: bytes) -> Attr:
        """A symlink (`body` is its target) or a special file (no body)."""
        parent, name, key = await self._free_name(parent_ino, name)
        got = await self.backend.make_node(key, attrs, body)
        inode = self._inode_for(key, got if isinstance(got, FileEntry) else None, False)
        if isinstance(got, ObjectRef):
            self._stored_in_s3(inode, got, attrs)
        inode.target = body if stat.S_ISLNK(attrs.mode) else None
        inode.size = len(body)
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if not inode.is_symlink:
            raise Invalid(inode.key)
        e = inode.overlay
        if isinstance(e, FileEntry):
            if e.target is not None:
                return e.target
            if e.base:
                return await self.store.get_range(e.base.key, e.base.etag, 0, e.base.size)
        if inode.target is None:
            inode.target = await self.store.get_range(inode.key, inode.etag, 0, inode.size)
        return inode.target

    # -- rename ---------------------------------------------------------------------------

    async def _rename_plan(self, old_parent: int, old_name: bytes | str, new_parent: int,
                           new_name: bytes | str, flags: int
                           ) -> tuple[Inode, Inode, str, Inode, str, Inode | None, str] | None:
        """The POSIX checks of a rename: (old parent, new parent, old name, source, new
        name, destination or None, new key), or None when it renames a file to itself."""
        self._writable()
        if flags & RENAME_EXCHANGE:
            raise Invalid("RENAME_EXCHANGE is not supported")
        op, np = self._dir(old_parent), self._dir(new_parent)
        old_name, new_name = _name(old_name), _name(new_name)
        src = await self._resolve(op, old_name)
        new_key = self._key(np, new_name)
        if new_key == src.key:
            return None
        try:
            dst: Inode | None = await self._resolve(np, new_name)
        except NotFound:
            dst = None
        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise Exists(new_name)
            if src.is_dir and not dst.is_dir:
                raise NotADirectory(dst.key)
            if not src.is_dir and dst.is_dir:
                raise IsADirectory(dst.key)
            if dst.is_dir and await self._list(dst, force=True):
                raise NotEmpty(dst.key)
        if src.is_dir and (new_key + "/").startswith(src.key + "/"):
            raise Invalid("cannot move a directory into itself")
        return op, np, old_name, src, new_name, dst, new_key

    def _attrs_of(self, key: str) -> Attrs | None:
        inode = self._by_key(key.rstrip("/"))
        return inode.attrs if inode is not None and inode.meta_loaded else None

    async def rename(self, old_parent: int, old_name: bytes | str, new_parent: int,
                     new_name: bytes | str, flags: int = 0) -> None:
        plan = await self._rename_plan(old_parent, old_name, new_parent, new_name, flags)
        if plan is None:
            return
        op, np, old_name, src, new_name, dst, new_key = plan
        old_key = src.key
        # A rename changes what was renamed (its ctime), not what is below it.
        now = time.time_ns()
        renamed = src.attrs.changed_at(now)

        def attrs_of(key: str) -> Attrs | None:
            if key == old_key and src.meta_loaded:
                return renamed
            return self._attrs_of(key)

        try:
            moved = await self.backend.rename(
                old_key, new_key, src.is_dir, dst is not None and dst.is_dir,
                bool(flags & RENAME_NOREPLACE), renamed if src.is_dir else None, attrs_of)
        except ObjcacheError:
            # Part of a tree may have moved (one node moves object by object): ask S3
            # again about both places rather than show what we knew before.
            self._stale_tree(old_key)
            self._stale_tree(new_key)
            np.listed = op.listed = 0.0
            raise
        if dst is not None:  # (its working copy went in backend.rename)
            if not dst.is_dir:
                self.router.drop_object(dst.key)
            self._forget_child(dst)
        self._moved_objects(moved)
        if op.children is not None:
            op.children.pop(old_name, None)
        self._rekey_inodes(old_key, new_key)
        src.ctime_ns = now
        lf = self.local.by_key.get(new_key)
        if lf is not None:
            lf.ctime_ns = now
        self._add_child(np, new_name, src)
        e = self.backend.entry(new_key + "/" if src.is_dir else new_key)
        if e is not None:
            self._show(src, e)
        op.mtime_ns, op.ctime_ns = np.mtime_ns, np.ctime_ns

    def _moved_objects(self, moved: list[Moved]) -> None:
        """S3 objects a rename copied: their cached chunks and inodes follow."""
        for m in moved:
            inode = self._by_key(m.old_key)
            old_etag = m.old_etag or (inode.etag if inode is not None else None)
            if old_etag:
                self.router.rekey(m.old_key, old_etag, m.new_key, m.new_etag)
            if inode is not None and not inode.is_dir:
                inode.etag = m.new_etag

    def _stale_tree(self, key: str) -> None:
        """Everything we know at or under `key` is asked for again (and the kernel's copy
        of it dropped)."""
        prefix = key + "/"
        for inode in list(self.inodes.values()):
            if inode.key == key or inode.key.startswith(prefix):
                inode.checked = inode.listed = 0.0
                parent = self._parent_of(inode.key)
                if parent is not None:
                    self.notify.entry(parent.ino, inode.key.rpartition("/")[2])

    def _rekey_inodes(self, old: str, new: str) -> None:
        old_prefix = old + "/"
        moved = [i for i in self.inodes.values()
                 if i.key == old or i.key.startswith(old_prefix)]
        for inode in moved:
            if self.by_key.get(inode.key) == inode.ino:
                del self.by_key[inode.key]
        for inode in moved:
            inode.key = new + inode.key[len(old):]
            stale = self.by_key.get(inode.key)
            if stale is not None and stale != inode.ino and stale in self.inodes:
                self._detach(self.inodes[stale])
            self.by_key[inode.key] = inode.ino

    # -- changes made elsewhere -----------------------------------------------------------

    def _apply_changes(self, changes: list[Change]) -> None:
        """Bring our inodes in line with changes another node committed (or an upload),
        and drop what the kernel cached of them."""
        for ch in changes:
            is_dir = ch.key.endswith("/")
            k = ch.key.rstrip("/")
            inode = self._by_key(k)
            if inode is not None and inode.is_dir != is_dir:
                inode = None  # a change to the other kind of thing with this name
            if ch.resync:
                self._resync(k, inode)
                continue
            if ch.uploaded is not None:
                if inode is not None:
                    lf = self.local.by_key.get(k)
                    clean = lf is not None and not lf.dirty and lf.etag == ch.uploaded.etag
                    self._stored_in_s3(inode, ch.uploaded, Attrs(
                        lf.mode, lf.uid, lf.gid, lf.mtime_ns) if clean and lf else None)
                continue
            if ch.ours:
                continue  # our own change: the call that made it updated us already
            lf = self.local.by_key.get(k)
            if lf is not None and not lf.dirty:
                # A closed working copy kept here (watched for writes through a mapping)
                # is older than what another node committed: it no longer shows the file.
                # One still open (often only until the RELEASE that follows a close,
                # which the kernel sends after close(2) returned) is set aside: an open
                # here used it, and read this node's older bytes instead of the committed
                # ones (a close-to-open violation the partition nemesis found).
                if lf.opens == 0:
                    self.local.remove(lf)
                else:
                    self.local.set_aside(lf)
            if ch.entry is None:
                if is_dir and self.backend.live_under(ch.key):
                    continue  # the marker goes; the directory (with children) stays
                if inode is not None:
                    self._gone(inode)
                continue
            if inode is not None and self._keeps_version(inode, ch.entry):
                # Handles open here keep reading the version they opened (NFS-like): that
                # inode leaves the name, which a new inode shows from now on.
                pino = self.by_key.get(parent_key(k))
                self._detach(inode)
                if pino is not None:
                    self.notify.entry(pino, k.rpartition("/")[2])
                inode = None
            if inode is not None:
                self._show(inode, ch.entry)
                self.notify.inode(inode.ino)
            else:
                self._add_listed(k, ch.entry, is_dir)

    def _keeps_version(self, inode: Inode, e: FileEntry | DirEntry) -> bool:
        """Whether `e` changes the content of a file that handles here have open for
        reading (without a working copy: those read what this node writes)."""
        if not isinstance(e, FileEntry) or inode.is_dir:
            return False
        old = inode.overlay
        if isinstance(old, FileEntry) and old.content == e.content:
            return False  # an attribute change: same bytes
        b = inode.backed
        if b is not None and (b.lf is None or b.lf.aside or b.lf.removed):
            # The kernel serves every open of the inode from one backing file, and that
            # one holds the version the open handles have (a working copy set aside, a
            # cached object version): a new open sharing it would read old bytes, and one
            # the daemon serves cannot be mixed with it.
            return True
        return any(h.inode is inode and h.lf is None for h in self.handles.values())

    def _resync(self, key: str, inode: Inode | None) -> None:
        """The backend no longer knows what became of `key` (see Change.resync): forget
        what we know of it, so that the next lookup and the next listing of its
        directory ask the backend and S3 again. Handles open on it keep their version,
        as with any change made elsewhere."""
        parent = self._parent_of(key)
        name = key.rpartition("/")[2]
        if parent is not None:
            parent.listed = 0.0
            if parent.children is not None:
                parent.children.pop(name, None)
            self.notify.entry(parent.ino, name)
        if inode is not None:
            inode.checked = inode.listed = 0.0
            if not inode.is_dir:  # (a directory keeps its inode: a cwd, its children)
                self._detach(inode)

    def _gone(self, inode: Inode) -> None:
        pino = self.by_key.get(parent_key(inode.key))
        name = inode.key.rpartition("/")[2]
        self._forget_child(inode)
        if pino is not None:
            self.notify.delete(pino, inode.ino, name)
            parent = self.inodes.get(pino)
            if parent is not None:
                parent.changed()

    def _add_listed(self, key: str, e: FileEntry | DirEntry, is_dir: bool) -> None:
        """Put a new entry into its parent's listing, if we have that listing."""
        parent = self._parent_of(key)
        if parent is None:
            return  # a lookup will find it among the entries
        listings = self._arrived.get(parent.ino)
        if parent.children is None and not listings:
            return  # (as will a listing)
        inode = self._inode_for(key, e if isinstance(e, DirEntry) == is_dir else None,
                                is_dir)
        name = key.rpartition("/")[2]
        for arrived in listings or ():
            arrived[name] = inode.ino  # the namespace those listings read had it not yet
        if parent.children is None:
            return
        parent.children[name] = inode.ino
        self.notify.entry(parent.ino, name)

    # -- write-back -----------------------------------------------------------------------

    async def _commit_open_files(self, scope: FlushScope) -> None:
        """What files still open here wrote becomes durable (before a flush or drain)."""
        self.local.observe_all()
        async def one(h: FileHandle) -> None:
            assert h.lf is not None
            e = await self.backend.close(h.inode.key, h.lf)
            if e is not None:
                self._show_own(h.inode, e)

        with first_error():
            async with trio.open_nursery() as n:
                for h in list(self.handles.values()):
                    if (h.lf is not None and h.lf.dirty and not h.lf.removed
                            and (scope.kind == "mine" or scope.covers(h.lf.key))):
                        n.start_soon(one, h)

    async def flush_scope(self, scope: FlushScope) -> int:
        """`objcache flush`: return once everything dirty in `scope` is in S3 (everything
        closed before the call, on any node: a barrier first)."""
        await self.sync()
        await self._commit_open_files(scope)
        return await self.backend.flush(scope)

    async def drain(self) -> int:
        """Before leaving: everything written here is made durable and written back."""
        await self._commit_open_files(FlushScope.mine())
        return await self.backend.drain()

    # -- misc -----------------------------------------------------------------------------

    def statfs(self) -> dict[str, int]:
        bsize = 4096
        cache = self.router.cache
        total = max(cache.capacity, 1 << 40) // bsize
        free = max(0, total - cache.used // bsize)
        return {"bsize": bsize, "blocks": total, "bfree": free, "files": 1 << 32,
                "ffree": 1 << 32, "namemax": NAME_MAX}

    def key_of(self, ino: int) -> str:
        return self.inode(ino).key
