"""The filesystem core: namespace, attributes, open files, and the POSIX operations.

It knows nothing about FUSE (objcache.fs.operations adapts it), so tests drive it directly.
Namespace changes (mkdir, unlink, rename, chmod, symlink) go to S3 at once; file data is
written back later by objcache.core.writeback. All state is owned by the trio thread.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from objcache import CTRL_NAME
from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFile, LocalFiles
from objcache.config import MountConfig
from objcache.core.inode import (
    CTRL_INO,
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    ROOT_INO,
    SYMLINK_MODE,
    Attr,
    Inode,
    child_key,
    make_meta,
    parent_key,
    parse_meta,
)
from objcache.errors import (
    Exists,
    Invalid,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotEmpty,
    NotFound,
    ObjcacheError,
    ReadOnly,
    first_error,
)

if TYPE_CHECKING:
    from objcache.core.writeback import Writeback
    from objcache.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024  # S3's limit on a key
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_COPY_PARALLEL = 16


@dataclass(slots=True)
class FileHandle:
    inode: Inode
    writable: bool
    lf: LocalFile | None = None
    etag: str | None = None  # the S3 version a read-only handle reads
    size: int = 0
    next_offset: int = -1  # where a sequential reader will read next (readahead)
    entry: dict[str, Any] | None = None  # cluster: the namespace entry the handle reads


RELIST_AFTER_STALE_LOOKUPS = 16
# Directories the kernel forgot keep their listings while fewer inodes than this are known
# (an inode is a few hundred bytes).
MAX_KEPT_INODES = 200_000
# A stat of a file known only from a LIST costs a HEAD (S3 lists no metadata). After this
# many such stats in one listed directory (`ls -l`, `du`, a reader opening its files) the
# rest of the directory is HEADed in the background, META_PREFETCH at a time, in listing
# order from there: the stats then find their answer in flight or done instead of paying
# one round trip each in sequence.
META_PREFETCH_AFTER = 4
META_PREFETCH = 16
META_PREFETCH_WINDOW = 512  # entries ahead of the last one stat'ed
META_READ_WINDOW = 64  # the same, in a directory whose files are being read


class _MetaPrefetch:
    """One directory's background HEADs, in listing order from where stats started."""

    def __init__(self, d: Inode, after: str) -> None:
        self.dir = d
        self.children = d.children or {}
        self.names = sorted(self.children)
        start = bisect.bisect_right(self.names, after)
        self.names = self.names[start:] + self.names[:start]
        self._pos = {n: i for i, n in enumerate(self.names)}
        self.next = 0  # index in `names` of the next one to fetch
        self.cursor = 0  # index of the furthest one stat'ed by a caller
        self.moved = trio.Event()

    def saw(self, name: str) -> None:
        i = self._pos.get(name)
        if i is not None and i > self.cursor:
            self.cursor = i
            self.moved.set()
            self.moved = trio.Event()


class Filesystem:
    """Attributes:
    inodes: ino -> Inode for everything the kernel or a listing may refer to.
    by_key: key -> ino (at most one live inode per key).
    """

    def __init__(self, cfg: MountConfig, store: ObjectStore, chunks: ChunkCache,
                 local: LocalFiles, uid: int | None = None, gid: int | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.chunks = chunks
        self.local = local
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.ttl = cfg.metadata_ttl
        self.readahead_chunks = max(1, cfg.readahead // cfg.chunk_size)
        self.inodes: dict[int, Inode] = {}
        self.by_key: dict[str, int] = {}
        self.handles: dict[int, FileHandle] = {}
        self._next_ino = ROOT_INO + 1
        self._next_fh = 1
        self._head_inflight: dict[str, trio.Event] = {}
        self._list_inflight: dict[int, trio.Event] = {}
        self._background: trio.Nursery | None = None
        self._meta_prefetching: dict[int, _MetaPrefetch] = {}  # by directory inode
        root = Inode(ROOT_INO, "", DEFAULT_DIR_MODE, self.uid, self.gid)
        root.mtime_ns = time.time_ns()
        root.lookups = 1
        self.inodes[ROOT_INO] = root
        self.by_key[""] = ROOT_INO
        self.mount_time_ns = root.mtime_ns

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the nursery of background metadata prefetches."""
        async with trio.open_nursery() as nursery:
            self._background = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._background = None

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
            if self.by_key.get(inode.key) == ino:
                del self.by_key[inode.key]
            del self.inodes[ino]

    def _parent_of(self, key: str) -> Inode | None:
        """The inode of `key`'s directory, if we know one."""
        pino = self.by_key.get(parent_key(key))
        return self.inodes.get(pino) if pino is not None else None

    def _listed_in_parent(self, inode: Inode) -> bool:
        parent = self._parent_of(inode.key)
        return bool(parent and parent.children is not None
                    and parent.children.get(inode.key.rpartition("/")[2]) == inode.ino)

    @staticmethod
    def _name(name: bytes | str) -> str:
        if isinstance(name, bytes):
            try:
                name = name.decode("utf-8")
            except UnicodeDecodeError:
                raise Invalid("file names must be UTF-8 (S3 keys are)") from None
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise Invalid(name)
        return name

    def _key(self, parent: Inode, name: str) -> str:
        key = child_key(parent.key, name)
        if len(key.encode()) + 1 > MAX_KEY_BYTES:
            raise NameTooLong(name)
        return key

    def _writable(self) -> None:
        if self.cfg.read_only:
            raise ReadOnly("mounted read-only")

    # -- attributes -----------------------------------------------------------------------

    def attr(self, inode: Inode) -> Attr:
        lf = self.local.by_key.get(inode.key) if not inode.is_dir else None
        if lf is not None:
            return Attr(inode.ino, lf.mode, lf.size, lf.uid, lf.gid, lf.mtime_ns, self.ttl)
        # Entries whose metadata only came from a LIST get no kernel caching, so that the
        # next stat asks us and we HEAD the object (its mode may even say symlink).
        timeout = self.ttl if inode.meta_loaded or inode.is_dir else 0.0
        return Attr(inode.ino, inode.mode, inode.size, inode.uid, inode.gid, inode.mtime_ns,
                    timeout)

    def _detached_attr(self, inode: Inode) -> Attr:
        """An unlinked file that is still open (fstat on its handle): its last attributes."""
        for h in self.handles.values():
            if h.inode is inode and h.lf is not None:
                lf = h.lf
                return Attr(inode.ino, lf.mode, lf.size, lf.uid, lf.gid, lf.mtime_ns, 0.0)
        if not any(h.inode is inode for h in self.handles.values()):
            raise NotFound(inode.key)
        return Attr(inode.ino, inode.mode, inode.size, inode.uid, inode.gid, inode.mtime_ns,
                    0.0)

    def ctrl_attr(self) -> Attr:
        return Attr(CTRL_INO, stat.S_IFREG | 0o666, 0, 0, 0, self.mount_time_ns, 0.0)

    def _apply_info(self, inode: Inode, info: ObjectInfo) -> Inode:
        """Update a file inode from S3's view; returns the inode now naming the key (a new
        one if the object's type changed, so the kernel never sees an inode change type)."""
        if inode.etag is not None and inode.etag != info.etag:
            inode.content_gen += 1
            inode.meta_loaded = False
            inode.target = None
            self.chunks.drop_object(inode.key, keep_etag=info.etag)
        if info.metadata is not None:
            mode, uid, gid, mtime_ns = parse_meta(info.metadata, DEFAULT_FILE_MODE, self.uid,
                                                  self.gid, info.mtime_ns)
            if stat.S_IFMT(mode) not in (stat.S_IFREG, stat.S_IFLNK):
                mode = DEFAULT_FILE_MODE | (mode & 0o7777)
            if stat.S_IFMT(mode) != stat.S_IFMT(inode.mode):
                new = self._new_inode(inode.key, mode)
                self._replace_child(inode, new)
                inode = new
            inode.mode, inode.uid, inode.gid, inode.mtime_ns = mode, uid, gid, mtime_ns
            inode.meta_loaded = True
        elif not inode.meta_loaded:
            inode.mtime_ns = info.mtime_ns
        inode.size = info.size
        inode.etag = info.etag
        inode.in_s3 = True
        inode.checked = time.monotonic()
        return inode

    def _replace_child(self, old: Inode, new: Inode) -> None:
        parent = self._parent_of(new.key)
        if parent is not None and parent.children is not None:
            parent.children[new.key.rpartition("/")[2]] = new.ino

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

    async def _revalidate(self, inode: Inode) -> Inode:
        """HEAD a file inode (coalescing concurrent callers); NotFound if it is gone."""
        key = inode.key
        ev = self._head_inflight.get(key)
        if ev is not None:
            await ev.wait()
        else:
            ev = self._head_inflight[key] = trio.Event()
            try:
                info = await self._head_file(inode)
                if info is None:
                    if self.by_key.get(key) == inode.ino and key not in self.local.by_key:
                        self._forget_child(inode)
                    raise NotFound(key)
                inode = self._apply_info(inode, info)
            finally:
                del self._head_inflight[key]
                ev.set()
        ino = self.by_key.get(key)
        if ino is None:
            raise NotFound(key)
        return self.inodes[ino]

    async def _head_file(self, inode: Inode) -> ObjectInfo | None:
        parent = self._parent_of(inode.key)
        if (not inode.meta_loaded and inode.etag is not None and parent is not None
                and parent.read_children
                and self.chunks.fetches_whole(inode.key, inode.size, inode.etag)):
            # Known only from a LIST, in a directory whose files are being read (not
            # just stat'ed, like `ls -l`): a small one is fetched whole by the same
            # request that tells its metadata.
            return await self.chunks.head_by_get(self.store, inode.key, inode.size)
        return await self.store.head(inode.key)

    def _listed_file_stat(self, inode: Inode) -> None:
        """A file known only from its directory's LIST is being stat'ed (see
        META_PREFETCH_AFTER)."""
        parent = self._parent_of(inode.key)
        if (parent is None or parent.children is None or self._background is None
                or parent.ino in self._meta_prefetching):
            return
        parent.meta_misses += 1
        if parent.meta_misses == META_PREFETCH_AFTER:
            pf = _MetaPrefetch(parent, inode.key.rpartition("/")[2])
            self._meta_prefetching[parent.ino] = pf
            self._background.start_soon(self._prefetch_meta, pf)

    async def _prefetch_meta(self, pf: _MetaPrefetch) -> None:
        d, children = pf.dir, pf.children

        async def worker() -> None:
            while pf.next < len(pf.names):
                if d.children is not children:
                    return  # listed again (or forgotten): the next stats start afresh
                # Far enough ahead of whoever is stat'ing: wait for them (or stop, when
                # they are done), so a few stats never fetch a whole directory. Files
                # being read are fetched whole (see _head_file): a shorter window.
                window = META_READ_WINDOW if d.read_children else META_PREFETCH_WINDOW
                if pf.next > pf.cursor + window:
                    with trio.move_on_after(self.ttl):
                        await pf.moved.wait()
                    if pf.next > pf.cursor + window:
                        return
                    continue
                name = pf.names[pf.next]
                pf.next += 1
                inode = self.inodes.get(children.get(name, -1))
                if (inode is None or inode.is_dir or inode.meta_loaded
                        or inode.key in self.local.by_key):
                    continue
                try:
                    await self._revalidate(inode)
                except ObjcacheError:
                    pass  # gone, or S3 trouble: the stat that wants it will say so

        try:
            async with trio.open_nursery() as n:
                for _ in range(META_PREFETCH):
                    n.start_soon(worker)
        finally:
            if self._meta_prefetching.get(d.ino) is pf:
                del self._meta_prefetching[d.ino]

    def _stat_seen(self, parent: Inode, name: str) -> None:
        """A lookup in `parent`: moves a running prefetch's window along."""
        pf = self._meta_prefetching.get(parent.ino)
        if pf is not None:
            pf.saw(name)

    def _forget_child(self, inode: Inode) -> None:
        parent = self._parent_of(inode.key)
        if parent is not None and parent.children is not None:
            parent.children.pop(inode.key.rpartition("/")[2], None)
        self._detach(inode)

    def _fresh(self, t: float) -> bool:
        return time.monotonic() - t < self.ttl

    async def _resolve(self, parent: Inode, name: str) -> Inode:
        """The child `name` of `parent`, asking S3 when our knowledge is stale."""
        key = self._key(parent, name)
        if self._meta_prefetching:
            self._stat_seen(parent, name)
        ino = parent.children.get(name) if parent.children is not None else None
        if ino is None:
            ino = self.by_key.get(key)
        inode = self.inodes.get(ino) if ino is not None else None
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
            raise NotFound(key)
        elif parent.stale_lookups >= RELIST_AFTER_STALE_LOOKUPS:
            # Many names looked up one by one in a directory nobody listed (a reader
            # opening its files by name): one LIST page per 1000 of them answers the rest
            # instead of a HEAD and a LIST each.
            await self._relist(parent)
            ino = (parent.children or {}).get(name)
            if ino is None or ino not in self.inodes:
                raise NotFound(key)
            return self.inodes[ino]
        else:
            parent.stale_lookups += 1
            info, is_dir = await self._head(key)
            ino = self.by_key.get(key)  # someone else may have created it meanwhile
            if ino is not None:
                return self.inodes[ino]
            if is_dir:
                inode = self._new_inode(key, DEFAULT_DIR_MODE)
                inode.in_s3 = True
            elif info is not None:
                inode = self._apply_info(self._new_inode(key, DEFAULT_FILE_MODE), info)
            else:
                raise NotFound(key)
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
                await self._list(d, force=True)
        finally:
            del self._list_inflight[d.ino]
            ev.set()

    async def lookup(self, parent_ino: int, name: bytes | str) -> Attr:
        parent = self._dir(parent_ino)
        name = self._name(name)
        if name == CTRL_NAME:
            return self.ctrl_attr()
        inode = await self._resolve(parent, name)
        inode.lookups += 1
        return self.attr(inode)

    async def getattr(self, ino: int) -> Attr:
        if ino == CTRL_INO:
            return self.ctrl_attr()
        inode = self.inode(ino)
        if (not inode.is_dir and inode.key not in self.local.by_key
                and not (inode.meta_loaded and self._fresh(inode.checked))):
            if inode.key.startswith("\0"):
                return self._detached_attr(inode)
            if not inode.meta_loaded:
                self._listed_file_stat(inode)
            fresh = await self._revalidate(inode)
            if fresh.ino != inode.ino:
                raise NotFound(inode.key)  # it became another type; the old inode is stale
            inode = fresh
        return self.attr(inode)

    # -- directories ----------------------------------------------------------------------

    async def _list(self, d: Inode, force: bool = False) -> dict[str, int]:
        if d.children is not None and not force and self._fresh(d.listed):
            return d.children
        started = time.monotonic()
        prefix = f"{d.key}/" if d.key else ""
        found: dict[str, ObjectInfo | None] = {}
        async for page in self.store.list_dir(prefix):
            for o in page.objects:
                name = o.key[len(prefix):]
                if not name:
                    d.in_s3 = True  # the directory's own marker
                elif self._valid_listed(name) and name not in found:
                    found[name] = o
            for p in page.prefixes:
                name = p[len(prefix):-1]
                if self._valid_listed(name):
                    found[name] = None  # a directory wins over a same-named object
        children: dict[str, int] = {}
        for name, info in found.items():
            key = prefix + name
            ino = self.by_key.get(key)
            inode = self.inodes.get(ino) if ino is not None else None
            if info is None:
                if inode is None or not inode.is_dir:
                    inode = self._new_inode(key, DEFAULT_DIR_MODE)
                inode.in_s3 = True
            else:
                if inode is None or inode.is_dir:
                    inode = self._new_inode(key, DEFAULT_FILE_MODE)
                inode = self._apply_info(inode, info)
            children[name] = inode.ino
        self._merge_unlisted(d, children)
        for name, ino in (d.children or {}).items():
            inode = self.inodes.get(ino)
            if name not in children and inode is not None and inode.created >= started:
                children[name] = ino
        if d.children is not None:
            for name, ino in d.children.items():
                if name not in children and ino in self.inodes:
                    inode = self.inodes[ino]
                    if inode.key == prefix + name:
                        self._detach(inode)
        d.children = children
        d.listed = time.monotonic()
        d.stale_lookups = d.meta_misses = d.read_children = 0
        return children

    def _merge_unlisted(self, d: Inode, children: dict[str, int]) -> None:
        """Add to a fresh listing what S3 does not show yet: files written here."""
        for key in self.local.by_key:
            if parent_key(key) == d.key and key.rpartition("/")[2] not in children:
                ino = self.by_key.get(key)
                inode = self.inodes[ino] if ino is not None else self._new_inode(
                    key, DEFAULT_FILE_MODE)
                children[key.rpartition("/")[2]] = inode.ino

    @staticmethod
    def _valid_listed(name: str) -> bool:
        return bool(name) and name not in (".", "..", CTRL_NAME) and "/" not in name

    async def readdir(self, ino: int) -> list[tuple[str, Attr]]:
        """A snapshot of the directory, sorted by name (the handle pages through it)."""
        d = self._dir(ino)
        children = await self._list(d)
        out = []
        for name in sorted(children):
            inode = self.inodes.get(children[name])
            if inode is not None:
                out.append((name, self.attr(inode)))
        return out

    def note_lookup(self, ino: int) -> None:
        """readdirplus handed the kernel an entry: that counts as a lookup."""
        inode = self.inodes.get(ino)
        if inode is not None:
            inode.lookups += 1

    async def mkdir(self, parent_ino: int, name: bytes | str, mode: int, uid: int,
                    gid: int) -> Attr:
        parent, name, key = await self._free_name(parent_ino, name)
        now = time.time_ns()
        mode = stat.S_IFDIR | (mode & 0o7777)
        await self.store.put_bytes(key + "/", b"", make_meta(mode, uid, gid, now))
        inode = self._new_inode(key, mode)
        inode.uid, inode.gid, inode.mtime_ns = uid, gid, now
        inode.in_s3 = True
        inode.children = {}
        inode.listed = time.monotonic()
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    def _add_child(self, parent: Inode, name: str, inode: Inode) -> None:
        if parent.children is not None:
            parent.children[name] = inode.ino
        parent.mtime_ns = time.time_ns()

    async def _free_name(self, parent_ino: int, name: bytes | str) -> tuple[Inode, str, str]:
        """(parent, name, key) for a new entry; EEXIST if the name is taken."""
        self._writable()
        parent = self._dir(parent_ino)
        name = self._name(name)
        await self._must_not_exist(parent, name)
        return parent, name, self._key(parent, name)

    async def _must_not_exist(self, parent: Inode, name: str) -> None:
        try:
            await self._resolve(parent, name)
        except NotFound:
            return
        raise Exists(name)

    async def _empty_dir(self, parent_ino: int, name: bytes | str) -> tuple[Inode, Inode]:
        """rmdir's checks: (the parent, the directory named), which must be empty."""
        self._writable()
        parent = self._dir(parent_ino)
        inode = await self._resolve(parent, self._name(name))
        if not inode.is_dir:
            raise NotADirectory(inode.key)
        if await self._list(inode, force=True):
            raise NotEmpty(inode.key)
        return parent, inode

    async def rmdir(self, parent_ino: int, name: bytes | str) -> None:
        parent, inode = await self._empty_dir(parent_ino, name)
        await self.store.delete(inode.key + "/")
        self._forget_child(inode)
        parent.mtime_ns = time.time_ns()

    # -- files ----------------------------------------------------------------------------

    def _make_local(self, inode: Inode) -> LocalFile:
        """The local file standing in for `inode` (created without copying any bytes)."""
        lf = self.local.by_key.get(inode.key)
        if lf is not None:
            return lf
        base = None
        if inode.in_s3 and inode.size > 0 and inode.etag:
            base = (inode.key, inode.etag, inode.size)
        return self.local.create(inode.key, inode.mode, inode.uid, inode.gid, inode.mtime_ns,
                                 base=base, etag=inode.etag if inode.in_s3 else None)

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

    async def open(self, ino: int, flags: int) -> tuple[int, bool]:
        """Returns (file handle, whether the kernel may keep its cached pages)."""
        inode = self.inode(ino)
        if inode.is_dir:
            raise IsADirectory(inode.key)
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if writable:
            self._writable()
        lf = self.local.by_key.get(inode.key)
        parent = self._parent_of(inode.key)
        if parent is not None:
            parent.read_children += 1  # see _head_file
        if lf is None and not (inode.meta_loaded and self._fresh(inode.checked)):
            # Close-to-open against S3: an open after the TTL sees a changed object.
            fresh = await self._revalidate(inode)
            if fresh.ino != inode.ino:
                raise NotFound(inode.key)
            lf = self.local.by_key.get(inode.key)
        if writable and flags & os.O_TRUNC:
            lf = self._make_local(inode)
            if lf.size:
                await self.local.truncate(lf, 0)
        fh = FileHandle(inode, writable, lf, inode.etag, inode.size)
        if lf is not None:
            self.local.opened(lf, writable)
        keep = inode.kernel_gen == inode.content_gen
        inode.kernel_gen = inode.content_gen
        return self._new_handle(fh), keep

    async def create(self, parent_ino: int, name: bytes | str, mode: int, flags: int,
                     uid: int, gid: int) -> tuple[int, Attr]:
        self._writable()
        parent = self._dir(parent_ino)
        name = self._name(name)
        key = self._key(parent, name)
        existing = self.local.by_key.get(key)
        if existing is not None:
            self.local.remove(existing)
        now = time.time_ns()
        lf = self.local.create(key, stat.S_IFREG | (mode & 0o7777), uid, gid, now)
        self.local.mark_dirty(lf)  # even an empty new file must reach S3
        inode = self._new_inode(key, lf.mode)
        inode.uid, inode.gid, inode.mtime_ns, inode.meta_loaded = uid, gid, now, True
        inode.lookups += 1
        inode.kernel_gen = inode.content_gen
        self._add_child(parent, name, inode)
        self.local.opened(lf, True)
        fh = self._new_handle(FileHandle(inode, True, lf))
        return fh, self.attr(inode)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self.handle(fh)
        lf = h.lf or self.local.by_key.get(h.inode.key)
        if lf is not None:
            return await self.local.read(lf, offset, size)
        if h.etag is None or offset >= h.size:
            return b""
        return await self._read_object(h, h.inode.key, h.etag, h.size, offset, size)

    async def _read_object(self, h: FileHandle, key: str, etag: str, obj_size: int,
                           offset: int, size: int) -> bytes:
        """Read an S3 object version through the chunk cache, with readahead."""
        if offset == h.next_offset or offset == 0:
            # Sequential: start the next chunks before waiting for this one, so a cold
            # reader has the whole readahead window in flight from its first read.
            cs = self.chunks.chunk_size
            self.chunks.readahead(key, etag, obj_size, offset // cs + 1,
                                  self.readahead_chunks)
        data = await self.chunks.read(key, etag, obj_size, offset, size)
        h.next_offset = offset + len(data)
        return data

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self.handle(fh)
        if not h.writable:
            raise Invalid("handle not open for writing")
        if h.lf is None:
            h.lf = self._make_local(h.inode)
            self.local.opened(h.lf, True)
        return await self.local.write(h.lf, offset, data)

    async def flush(self, fh: int) -> None:
        """close(): journal size and mtime so a crash after close() loses nothing."""
        h = self.handle(fh)
        if h.lf is not None and h.lf.dirty:
            self.local.save(h.lf)
            self.local.changed.set()

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and h.lf is not None:
            self.local.closed(h.lf, h.writable)

    async def fsync(self, fh: int, writeback: Writeback) -> None:
        """Upload the file before returning."""
        h = self.handle(fh)
        lf = h.lf or self.local.by_key.get(h.inode.key)
        if lf is not None and lf.dirty:
            self.local.save(lf)
            await writeback.upload(lf, raise_errors=True)
            self.uploaded(lf)

    def uploaded(self, lf: LocalFile) -> None:
        """Bring the inode in line with a just-uploaded local file."""
        ino = self.by_key.get(lf.key)
        if ino is not None and not lf.dirty and lf.etag:
            inode = self.inodes[ino]
            inode.etag, inode.size, inode.in_s3 = lf.etag, lf.size, True
            inode.mode, inode.uid, inode.gid, inode.mtime_ns = lf.mode, lf.uid, lf.gid, \
                lf.mtime_ns
            inode.meta_loaded = True
            inode.checked = time.monotonic()

    async def setattr(self, ino: int, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None, fh: int | None = None) -> Attr:
        if ino == CTRL_INO:
            return self.ctrl_attr()
        self._writable()
        inode = self.inode(ino)
        lf = self.local.by_key.get(inode.key) if not inode.is_dir else None
        if size is not None:
            if inode.is_dir:
                raise IsADirectory(inode.key)
            lf = lf or self._make_local(inode)
            await self.local.truncate(lf, size)
        if mode is None and uid is None and gid is None and mtime_ns is None:
            return self.attr(inode)
        cur = (lf.mode, lf.uid, lf.gid, lf.mtime_ns) if lf else (inode.mode, inode.uid,
                                                                  inode.gid, inode.mtime_ns)
        new_mode = cur[0] if mode is None else (stat.S_IFMT(cur[0]) | (mode & 0o7777))
        new = (new_mode, cur[1] if uid is None else uid, cur[2] if gid is None else gid,
               cur[3] if mtime_ns is None else mtime_ns)
        if lf is not None:
            lf.mode, lf.uid, lf.gid, lf.mtime_ns = new
            if lf.dirty:
                self.local.save(lf)
            else:
                # Clean copy of an S3 object: rewrite its metadata server-side.
                async with lf.lock:
                    etag = await self.store.copy(lf.key, lf.key, make_meta(*new))
                    lf.etag = etag
                    self.local.save(lf)
        elif inode.is_dir:
            if inode.key:  # the root has no marker to carry metadata
                await self.store.put_bytes(inode.key + "/", b"", make_meta(*new))
        else:
            etag = await self.store.copy(inode.key, inode.key, make_meta(*new))
            if inode.etag and etag != inode.etag:
                self.chunks.rekey(inode.key, inode.etag, inode.key, etag)
            inode.etag = etag
        inode.mode, inode.uid, inode.gid, inode.mtime_ns = new
        inode.meta_loaded = True
        inode.checked = time.monotonic()
        return self.attr(inode)

    async def unlink(self, parent_ino: int, name: bytes | str) -> None:
        self._writable()
        parent = self._dir(parent_ino)
        inode = await self._resolve(parent, self._name(name))
        if inode.is_dir:
            raise IsADirectory(inode.key)
        key = inode.key
        lf = self.local.by_key.get(key)
        in_s3 = inode.in_s3
        if lf is not None:
            async with lf.lock:
                in_s3 = in_s3 or lf.etag is not None
                self.local.remove(lf)
        if in_s3:
            await self.store.delete(key)
        self.chunks.drop_object(key)
        self._forget_child(inode)
        parent.mtime_ns = time.time_ns()

    async def symlink(self, parent_ino: int, name: bytes | str, target: bytes, uid: int,
                      gid: int) -> Attr:
        parent, name, key = await self._free_name(parent_ino, name)
        now = time.time_ns()
        etag = await self.store.put_bytes(key, target, make_meta(SYMLINK_MODE, uid, gid, now))
        inode = self._new_inode(key, SYMLINK_MODE)
        inode.uid, inode.gid, inode.mtime_ns, inode.size = uid, gid, now, len(target)
        inode.etag, inode.target, inode.in_s3, inode.meta_loaded = etag, target, True, True
        inode.checked = time.monotonic()
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if not inode.is_symlink:
            raise Invalid(inode.key)
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
        old_name, new_name = self._name(old_name), self._name(new_name)
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

    async def rename(self, old_parent: int, old_name: bytes | str, new_parent: int,
                     new_name: bytes | str, flags: int = 0) -> None:
        plan = await self._rename_plan(old_parent, old_name, new_parent, new_name, flags)
        if plan is None:
            return
        op, np, old_name, src, new_name, dst, new_key = plan
        if dst is not None:
            if dst.is_dir:
                await self.store.delete(dst.key + "/")
            else:
                dlf = self.local.by_key.get(dst.key)
                if dlf is not None:
                    async with dlf.lock:
                        self.local.remove(dlf)
                self.chunks.drop_object(dst.key)
            self._forget_child(dst)
        if src.is_dir:
            await self._rename_dir(src, new_key)
        else:
            await self._rename_object(src.key, new_key, src)
        old_key = src.key
        if op.children is not None:
            op.children.pop(old_name, None)
        self._rekey_inodes(old_key, new_key)
        self._add_child(np, new_name, src)
        op.mtime_ns = np.mtime_ns

    async def _rename_object(self, old: str, new: str, inode: Inode | None) -> None:
        """Move one file or symlink: server-side copy + delete in S3, re-key local state."""
        lf = self.local.by_key.get(old)
        async with AsyncExitStack() as stack:
            if lf is not None:
                await stack.enter_async_context(lf.lock)
            exists = (inode.in_s3 if inode is not None else True) or (
                lf is not None and lf.etag is not None)
            if exists:
                old_etag = inode.etag if inode is not None else None
                etag = await self.store.copy(old, new)
                await self.store.delete(old)
                if old_etag:
                    self.chunks.rekey(old, old_etag, new, etag)
                if inode is not None:
                    inode.etag = etag
                if lf is not None:
                    if lf.base_key == old:
                        lf.base_key, lf.base_etag = new, etag
                    if not lf.dirty:
                        lf.etag = etag
            if lf is not None:
                self.local.rekey(lf, new)

    async def _rename_dir(self, d: Inode, new_key: str) -> None:
        """Move every object under the directory (not atomic: see docs/semantics.md)."""
        old_prefix, new_prefix = d.key + "/", new_key + "/"
        objs = [o async for o in self.store.list_recursive(old_prefix)]
        local_keys = {k for k in self.local.by_key if k.startswith(old_prefix)}
        limiter = trio.CapacityLimiter(_COPY_PARALLEL)
        s3_keys = {o.key for o in objs}

        async def move(key: str) -> None:
            async with limiter:
                dest = new_prefix + key[len(old_prefix):]
                if key == old_prefix:
                    # A marker carries no data; some servers (SeaweedFS) cannot copy one.
                    await self.store.put_bytes(dest, b"", make_meta(d.mode, d.uid, d.gid,
                                                                    d.mtime_ns))
                    await self.store.delete(key)
                    return
                ino = self.by_key.get(key)
                await self._rename_object(key, dest, self.inodes.get(ino) if ino else None)

        with first_error():
            async with trio.open_nursery() as n:
                for key in sorted(s3_keys | local_keys):
                    n.start_soon(move, key)
        if not objs and not local_keys:
            # An empty directory without a marker only existed in our memory: give it one.
            await self.store.put_bytes(new_prefix, b"", make_meta(d.mode, d.uid, d.gid,
                                                                  d.mtime_ns))

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

    # -- misc -----------------------------------------------------------------------------

    def statfs(self) -> dict[str, int]:
        bsize = 4096
        total = max(self.chunks.capacity, 1 << 40) // bsize
        free = max(0, total - self.chunks.used // bsize)
        return {"bsize": bsize, "blocks": total, "bfree": free, "files": 1 << 32,
                "ffree": 1 << 32, "namemax": 255}

    def key_of(self, ino: int) -> str:
        return self.inode(ino).key
