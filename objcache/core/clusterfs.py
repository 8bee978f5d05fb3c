"""The filesystem core of a cluster member: the same POSIX operations as `Filesystem`, with
namespace changes and closed files committed through the Raft log instead of written to S3.

What a node shows is S3 (through objcache.txn.overlay, which hides what was deleted) plus
the replicated namespace entries (objcache.txn.namespace): files closed but not uploaded,
new directories, renamed trees. Every change here is one transaction (TxnClient.submit);
S3 is brought up to date later by each key's owner (objcache.txn.flusher). Changes that
other nodes commit arrive through `apply_changes`, which updates this node's inodes and
tells the kernel to drop what it cached (close-to-open across nodes).

Files open for writing have a working copy here (LocalFiles); close() seals it into a blob,
has it replicated, then commits the entry that names the blob and its holders.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

from objcache.cache.localfiles import LocalFile
from objcache.core.filesystem import RENAME_NOREPLACE, FileHandle, Filesystem
from objcache.core.inode import (
    CTRL_INO,
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    SYMLINK_MODE,
    Attr,
    Inode,
    parent_key,
    parse_meta,
)
from objcache.errors import (
    Invalid,
    IsADirectory,
    NotFound,
    PeerError,
    first_error,
)
from objcache.txn.coordinator import Gone, TxnClient
from objcache.txn.dirtystore import DirtyStore
from objcache.txn.namespace import DIR, FILE, TOMB
from objcache.txn.overlay import OverlayStore

if TYPE_CHECKING:
    from objcache.cache.chunks import ChunkCache
    from objcache.cache.localfiles import LocalFiles
    from objcache.config import MountConfig
    from objcache.core.writeback import Writeback

log = logging.getLogger(__name__)



class KernelNotifier(Protocol):
    """What the FUSE layer does when another node changed something we may have cached."""

    def entry(self, parent_ino: int, name: str) -> None: ...

    def inode(self, ino: int) -> None: ...

    def attrs_now(self, ino: int) -> None: ...


class NoNotifier:
    def entry(self, parent_ino: int, name: str) -> None:
        pass

    def inode(self, ino: int) -> None:
        pass

    def attrs_now(self, ino: int) -> None:
        pass


def _content(e: dict[str, Any] | None) -> Any:
    if e is None:
        return None
    return (e.get("cid"), tuple(e["base"]) if e.get("base") else None, e.get("size"),
            e.get("target"))


class ClusterFilesystem(Filesystem):
    def __init__(self, cfg: MountConfig, store: OverlayStore, chunks: ChunkCache,
                 local: LocalFiles, txn: TxnClient, dirty: DirtyStore) -> None:
        super().__init__(cfg, store, chunks, local)  # type: ignore[arg-type]
        self.raw = store.store  # S3 itself, for existence checks that must see tombstoned keys
        self.txn = txn
        self.dirty = dirty
        self.notify: KernelNotifier = NoNotifier()

    # -- the replicated entries -----------------------------------------------------------

    def _entry(self, key: str) -> dict[str, Any] | None:
        st = self.txn.state
        with st.lock:
            e = st.ns.get(key)
            return dict(e) if e is not None else None

    def _live_under(self, prefix: str) -> bool:
        st = self.txn.state
        with st.lock:
            return st.ns.live_under(prefix)

    def _sync(self, inode: Inode, e: dict[str, Any]) -> None:
        """Show entry `e` (live, of the inode's type) on `inode`."""
        if not inode.is_dir and _content(e) != _content(inode.overlay):
            inode.content_gen += 1
            inode.target = e.get("target")
        inode.mode, inode.uid, inode.gid, inode.mtime_ns = e["mode"], e["uid"], e["gid"], \
            e["mtime"]
        if e["t"] == FILE:
            inode.size = e["size"]
        inode.meta_loaded = True
        inode.checked = time.monotonic()
        inode.overlay = e

    def _inode_for(self, key: str, e: dict[str, Any] | None, is_dir: bool) -> Inode:
        """The inode naming `key`, made or re-typed as needed, synced with `e`."""
        ino = self.by_key.get(key)
        inode = self.inodes.get(ino) if ino is not None else None
        mode = (e["mode"] if e is not None else DEFAULT_DIR_MODE if is_dir
                else DEFAULT_FILE_MODE)
        if inode is None or stat.S_IFMT(inode.mode) != stat.S_IFMT(mode):
            inode = self._new_inode(key, mode)
            if is_dir:
                inode.in_s3 = False
        if e is not None:
            self._sync(inode, e)
        return inode

    def _overlay_child(self, key: str) -> Inode | None:
        e = self._entry(key)
        if e is not None and e["t"] == FILE:
            return self._inode_for(key, e, False)
        d = self._entry(key + "/")
        if (d is not None and d["t"] == DIR) or self._live_under(key + "/"):
            return self._inode_for(key, d if d is not None and d["t"] == DIR else None, True)
        return None

    # -- lookups and listings -------------------------------------------------------------

    async def _resolve(self, parent: Inode, name: str) -> Inode:
        key = self._key(parent, name)
        inode = self._overlay_child(key)
        if inode is not None:
            if parent.children is not None:
                parent.children[name] = inode.ino
            return inode
        ino = self.by_key.get(key)
        cached = self.inodes.get(ino) if ino is not None else None
        if cached is not None and cached.overlay is not None:
            # It was an entry a moment ago (now uploaded, or gone): ask S3 afresh.
            cached.overlay = None
            cached.meta_loaded = False
            if cached.is_dir:
                self._forget_child(cached)
        return await super()._resolve(parent, name)

    async def lookup(self, parent_ino: int, name: bytes | str) -> Attr:
        try:
            return await super().lookup(parent_ino, name)
        except NotFound:
            # Maybe another node created it an instant ago: catch up with the log once.
            await self.txn.barrier()
            return await super().lookup(parent_ino, name)

    async def _revalidate(self, inode: Inode) -> Inode:
        e = self._entry(inode.key)
        if e is not None and e["t"] == FILE:
            self._sync(inode, e)
            return inode
        inode.overlay = None
        return await super()._revalidate(inode)

    def _merge_unlisted(self, d: Inode, children: dict[str, int]) -> None:
        super()._merge_unlisted(d, children)
        prefix = f"{d.key}/" if d.key else ""
        st = self.txn.state
        with st.lock:
            under = [(k, dict(e)) for k, e in st.ns.under(prefix)]
        for k, e in under:
            rest = k[len(prefix):]
            if e["t"] == TOMB or not rest:
                continue
            name, sep, _ = rest.partition("/")
            if not self._valid_listed(name):
                continue
            key = prefix + name
            if sep:
                exact = e if rest == name + "/" and e["t"] == DIR else None
                ino = children.get(name)
                inode = self.inodes.get(ino) if ino is not None else None
                if inode is None or not inode.is_dir or exact is not None:
                    inode = self._inode_for(key, exact, True)
            else:
                inode = self._inode_for(key, e, False)
            children[name] = inode.ino

    async def readdir(self, ino: int) -> list[tuple[str, Attr]]:
        await self.txn.barrier()  # a listing shows every change committed before it
        return await super().readdir(ino)

    # -- open files -----------------------------------------------------------------------

    async def open(self, ino: int, flags: int) -> tuple[int, bool]:
        inode = self.inode(ino)
        if inode.is_dir:
            raise IsADirectory(inode.key)
        await self.txn.barrier()  # close-to-open: every close committed before this
        e = self._entry(inode.key)
        if e is None or e["t"] != FILE:
            if inode.overlay is not None:  # uploaded or removed since: ask S3
                inode.overlay = None
                inode.meta_loaded = False
            return await super().open(ino, flags)
        self._sync(inode, e)
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        lf = self.local.by_key.get(inode.key)
        if writable:
            self._writable()
            if lf is None:
                lf = await self._working_copy(inode, e, bool(flags & os.O_TRUNC))
            elif flags & os.O_TRUNC and lf.size:
                await self.local.truncate(lf, 0)
        fh = FileHandle(inode, writable, lf, None, e["size"], entry=e)
        if lf is not None:
            self.local.opened(lf, writable)
        keep = inode.kernel_gen == inode.content_gen
        if not keep:
            self.notify.attrs_now(inode.ino)  # the kernel's size may be another node's old
        inode.kernel_gen = inode.content_gen
        return self._new_handle(fh), keep

    async def _working_copy(self, inode: Inode, e: dict[str, Any] | None,
                            empty: bool = False) -> LocalFile:
        """A local file to write, holding the entry's content (none of it if `empty`)."""
        lf = self.local.by_key.get(inode.key)
        if lf is not None:
            return lf
        if e is None:
            e = self._entry(inode.key)
        if e is None or e["t"] != FILE:
            return self._make_local(inode)
        base = e.get("base")
        if base and not empty:
            return self.local.create(inode.key, e["mode"], e["uid"], e["gid"], e["mtime"],
                                     base=(base[0], base[1], base[2]))
        lf = self.local.create(inode.key, e["mode"], e["uid"], e["gid"], e["mtime"])
        size = 0 if empty else e["size"]
        if e.get("cid") and size:
            cid, holders = e["cid"], e["holders"]

            async def piece(off: int, n: int) -> bytes:
                return await self.txn.read_blob(cid, holders, off, n)

            await self.local.fill(lf, size, piece)
        return lf

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self.handle(fh)
        e = h.entry
        if e is None or h.lf is not None or h.inode.key in self.local.by_key:
            return await super().read(fh, offset, size)
        n = min(size, e["size"] - offset)
        if n <= 0:
            return b""
        if e.get("cid"):
            try:
                return await self.txn.read_blob(e["cid"], e["holders"], offset, n)
            except (PeerError, NotFound):
                if h.inode.overlay is not None or not h.inode.etag:
                    raise
                # Uploaded (and its blob dropped) while we read: S3 has the same bytes.
                return await self.chunks.read(h.inode.key, h.inode.etag, e["size"],
                                              offset, n)
        base = e.get("base")
        if base:
            n = min(n, base[2] - offset)
            if n <= 0:
                return b""
            return await self._read_object(h, base[0], base[1], base[2], offset, n)
        return b""

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self.handle(fh)
        if not h.writable:
            raise Invalid("handle not open for writing")
        if h.lf is None:
            h.lf = await self._working_copy(h.inode, h.entry)
            self.local.opened(h.lf, True)
        return await self.local.write(h.lf, offset, data)

    async def flush(self, fh: int) -> None:
        """close(): seal the content, replicate it, commit it (the close returns after)."""
        h = self.handle(fh)
        if h.lf is not None and h.lf.dirty:
            await self._commit_content(h.inode, h.lf)

    async def fsync(self, fh: int, writeback: Writeback | None = None) -> None:
        """In a cluster, durable = replicated and committed (upload is the owner's)."""
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None or h.lf is None:
            return
        lf = h.lf
        if lf.dirty and not lf.removed:
            try:
                await self._commit_content(h.inode, lf)
            except Exception:
                log.exception("could not commit %r at release; its changes are lost", lf.key)
        self.local.closed(lf, h.writable)
        if lf.opens == 0 and not lf.dirty:
            self.local.remove(lf)  # the sealed blob keeps the content

    async def _commit_content(self, inode: Inode, lf: LocalFile) -> None:
        async with lf.lock:
            if not lf.dirty or lf.removed:
                return
            version = lf.version
            await self.local.materialize_all(lf)
            cid = self.txn.new_cid()
            self.dirty.seal(cid, lf.path, lf.size)
            lf.shared = True
            holders = await self.txn.replicate(lf.key, cid, lf.size)
            e = {"size": lf.size, "cid": cid, "holders": holders, "base": None,
                 "target": None, "mode": lf.mode, "uid": lf.uid, "gid": lf.gid,
                 "mtime": lf.mtime_ns, "at": time.time()}
            try:
                res = await self.txn.submit({"op": "ns.commit", "key": lf.key, "e": e,
                                             "must_exist": inode.overlay is not None})
            except Gone:
                log.info("%r was removed by another node while open here", lf.key)
                lf.dirty = False
                self.dirty.drop(cid)
                return
            if lf.version == version:
                lf.dirty = False
                lf.dirty_since = None
                self.local.save(lf)
            e["ver"] = res.get("ver", 0)
            e["t"] = FILE
            if inode.key == lf.key:
                self._sync(inode, e)
                inode.kernel_gen = inode.content_gen  # our own pages are current

    # -- namespace changes ----------------------------------------------------------------

    def _now_entry(self, mode: int, uid: int, gid: int, **more: Any) -> dict[str, Any]:
        return {"mode": mode, "uid": uid, "gid": gid, "mtime": time.time_ns(),
                "at": time.time(), **more}

    async def create(self, parent_ino: int, name: bytes | str, mode: int, flags: int,
                     uid: int, gid: int) -> tuple[int, Attr]:
        self._writable()
        parent = self._dir(parent_ino)
        name = self._name(name)
        key = self._key(parent, name)
        mode = stat.S_IFREG | (mode & 0o7777)
        e = self._now_entry(mode, uid, gid, size=0, cid=None, holders=[], base=None,
                            target=None)
        res = await self.txn.submit({"op": "ns.create", "key": key, "e": e,
                                     "excl": bool(flags & os.O_EXCL)})
        e.update(t=FILE, ver=res.get("ver", 0))
        old = self.local.by_key.get(key)
        if old is not None:
            self.local.remove(old)
        lf = self.local.create(key, mode, uid, gid, e["mtime"])
        inode = self._inode_for(key, e, False)
        inode.lookups += 1
        inode.kernel_gen = inode.content_gen
        self._add_child(parent, name, inode)
        self.local.opened(lf, True)
        fh = self._new_handle(FileHandle(inode, True, lf, None, 0, entry=e))
        return fh, self.attr(inode)

    async def mkdir(self, parent_ino: int, name: bytes | str, mode: int, uid: int,
                    gid: int) -> Attr:
        parent, name, key = await self._free_name(parent_ino, name)
        e = self._now_entry(stat.S_IFDIR | (mode & 0o7777), uid, gid)
        res = await self.txn.submit({"op": "ns.create", "key": key + "/", "e": e})
        e.update(t=DIR, ver=res.get("ver", 0))
        inode = self._inode_for(key, e, True)
        inode.children = {}
        inode.listed = time.monotonic()
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    async def symlink(self, parent_ino: int, name: bytes | str, target: bytes, uid: int,
                      gid: int) -> Attr:
        parent, name, key = await self._free_name(parent_ino, name)
        e = self._now_entry(SYMLINK_MODE, uid, gid, size=len(target), cid=None, holders=[],
                            base=None, target=bytes(target))
        res = await self.txn.submit({"op": "ns.create", "key": key, "e": e})
        e.update(t=FILE, ver=res.get("ver", 0))
        inode = self._inode_for(key, e, False)
        inode.lookups += 1
        self._add_child(parent, name, inode)
        return self.attr(inode)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        e = self._entry(inode.key)
        if e is not None and e["t"] == FILE and e.get("target") is not None:
            return bytes(e["target"])
        if e is not None and e.get("base"):
            b = e["base"]
            return await self.store.get_range(b[0], b[1], 0, b[2])
        return await super().readlink(ino)

    async def _in_s3(self, key: str) -> bool:
        """Whether S3 holds an object at `key` that is not already tombstoned."""
        e = self._entry(key)
        if e is not None and e["t"] == TOMB:
            return False
        return await self.raw.head(key) is not None

    async def unlink(self, parent_ino: int, name: bytes | str) -> None:
        self._writable()
        parent = self._dir(parent_ino)
        inode = await self._resolve(parent, self._name(name))
        if inode.is_dir:
            raise IsADirectory(inode.key)
        key = inode.key
        await self.txn.submit({"op": "ns.unlink", "key": key, "s3": await self._in_s3(key)})
        lf = self.local.by_key.get(key)
        if lf is not None:
            self.local.remove(lf)
        self.chunks.drop_object(key)
        self._forget_child(inode)
        parent.mtime_ns = time.time_ns()

    async def rmdir(self, parent_ino: int, name: bytes | str) -> None:
        parent, inode = await self._empty_dir(parent_ino, name)
        await self.txn.submit({"op": "ns.rmdir", "key": inode.key + "/",
                               "s3": await self._in_s3(inode.key + "/")})
        self._forget_child(inode)
        parent.mtime_ns = time.time_ns()

    async def rename(self, old_parent: int, old_name: bytes | str, new_parent: int,
                     new_name: bytes | str, flags: int = 0) -> None:
        plan = await self._rename_plan(old_parent, old_name, new_parent, new_name, flags)
        if plan is None:
            return
        op, np, old_name, src, new_name, dst, new_key = plan
        old_key = src.key
        lf = self.local.by_key.get(old_key)
        if lf is not None and lf.dirty:
            await self._commit_content(src, lf)  # what moves is what was written so far
        objects = await self._s3_objects(src)
        d = src if src.is_dir else None
        await self.txn.submit({
            "op": "ns.rename", "src": old_key, "dst": new_key, "dir": src.is_dir,
            "objects": objects, "noreplace": bool(flags & RENAME_NOREPLACE),
            "at": time.time(),
            "e": {"mode": d.mode, "uid": d.uid, "gid": d.gid, "mtime": d.mtime_ns}
            if d is not None else None})
        if dst is not None:
            dlf = self.local.by_key.get(dst.key)
            if dlf is not None:
                self.local.remove(dlf)
            self._forget_child(dst)
        for k in [k for k in self.local.by_key
                  if k == old_key or k.startswith(old_key + "/")]:
            self.local.rekey(self.local.by_key[k], new_key + k[len(old_key):])
        if op.children is not None:
            op.children.pop(old_name, None)
        self._rekey_inodes(old_key, new_key)
        self._add_child(np, new_name, src)
        e = self._entry(new_key + "/" if src.is_dir else new_key)
        if e is not None and e["t"] != TOMB:
            self._sync(src, e)
        op.mtime_ns = np.mtime_ns

    async def _s3_objects(self, src: Inode) -> list[list[Any]]:
        """The S3 objects a rename of `src` moves, with their attributes."""
        if not src.is_dir:
            if not await self._in_s3(src.key):
                return []
            info = await self.raw.head(src.key)
            if info is None:
                return []
            mode, uid, gid, mtime = parse_meta(info.metadata or {}, DEFAULT_FILE_MODE,
                                               self.uid, self.gid, info.mtime_ns)
            return [[src.key, info.etag, info.size, mode, uid, gid, mtime]]
        out: list[list[Any]] = []
        async for o in self.store.list_recursive(src.key + "/"):
            # A LIST has no metadata: copies keep the object's own (the entry only shows
            # defaults until write-back), see _heads below for what we know better.
            mode = DEFAULT_DIR_MODE if o.key.endswith("/") else DEFAULT_FILE_MODE
            out.append([o.key, o.etag, o.size, mode, self.uid, self.gid, o.mtime_ns])
        self._known_attrs(out)
        return out

    def _known_attrs(self, objects: list[list[Any]]) -> None:
        """Fill in real attributes for objects whose inodes we have loaded metadata for."""
        for o in objects:
            ino = self.by_key.get(o[0].rstrip("/"))
            inode = self.inodes.get(ino) if ino is not None else None
            if inode is not None and inode.meta_loaded:
                o[3], o[4], o[5], o[6] = inode.mode, inode.uid, inode.gid, inode.mtime_ns

    async def setattr(self, ino: int, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None, fh: int | None = None) -> Attr:
        if ino == CTRL_INO:
            return self.ctrl_attr()
        self._writable()
        inode = self.inode(ino)
        e = self._entry(inode.key + "/" if inode.is_dir else inode.key)
        if e is not None and e["t"] == TOMB:
            e = None
        cur = (inode.mode, inode.uid, inode.gid, inode.mtime_ns)
        new = (cur[0] if mode is None else stat.S_IFMT(cur[0]) | (mode & 0o7777),
               cur[1] if uid is None else uid, cur[2] if gid is None else gid,
               cur[3] if mtime_ns is None else mtime_ns)
        if inode.is_dir:
            if size is not None:
                raise IsADirectory(inode.key)
            if new != cur and inode.key:
                d = {"mode": new[0], "uid": new[1], "gid": new[2], "mtime": new[3],
                     "at": time.time()}
                res = await self.txn.submit({"op": "ns.setdir", "key": inode.key + "/",
                                             "e": d})
                self._sync(inode, dict(d, t=DIR, ver=res.get("ver", 0)))
            return self.attr(inode)
        lf = self.local.by_key.get(inode.key)
        if size is not None:
            lf = lf or await self._working_copy(inode, e)
            await self.local.truncate(lf, size)
        if lf is not None:
            lf.mode, lf.uid, lf.gid, lf.mtime_ns = new
            if lf.dirty or new != cur:
                lf.dirty = True
                lf.version += 1
            if lf.opens == 0:  # truncate(2)/chmod(2) on a path: commit now
                await self._commit_content(inode, lf)
                if not lf.dirty:
                    self.local.remove(lf)
            else:
                inode.mode, inode.uid, inode.gid, inode.mtime_ns = new
                inode.size = lf.size
            return self.attr(inode)
        if new == cur:
            return self.attr(inode)
        if e is None:  # a clean S3 file: it gets a server-side copy with the new metadata
            if not inode.etag:
                await self._revalidate(inode)
            e = {"size": inode.size, "cid": None, "holders": [], "target": None,
                 "base": [inode.key, inode.etag, inode.size]}
        e = {**e, "mode": new[0], "uid": new[1], "gid": new[2], "mtime": new[3],
             "at": time.time()}
        e.pop("ver", None)
        e.pop("t", None)
        res = await self.txn.submit({"op": "ns.commit", "key": inode.key, "e": e,
                                     "must_exist": inode.overlay is not None})
        self._sync(inode, dict(e, t=FILE, ver=res.get("ver", 0)))
        return self.attr(inode)

    # -- changes committed by other nodes -------------------------------------------------

    def apply_changes(self, changes: list[tuple[str, dict[str, Any] | None, Any]],
                      by: str | None) -> None:
        """Bring our inodes in line with a command another node committed (or an upload
        of ours), and drop what the kernel cached of them. Runs on the trio thread."""
        for key, e, extra in changes:
            is_dir = key.endswith("/")
            k = key.rstrip("/")
            ino = self.by_key.get(k)
            inode = self.inodes.get(ino) if ino is not None else None
            if inode is not None and inode.is_dir != is_dir:
                inode = None  # a change to the other kind of thing with this name
            if e is None and isinstance(extra, dict):  # uploaded: S3 holds it now
                if inode is not None:
                    inode.in_s3 = True
                    inode.overlay = None
                    if not is_dir and extra.get("etag"):
                        inode.etag = str(extra["etag"])
                        inode.checked = time.monotonic()
                continue
            if by == self.txn.node_id:
                continue  # our own change: the call that made it updated us already
            if e is None or e["t"] == TOMB:
                if is_dir and self._live_under(key):
                    continue  # the marker goes; the directory (with children) stays
                if inode is not None:
                    self._gone(inode)
                continue
            if inode is not None:
                self._sync(inode, e)
                self.notify.inode(inode.ino)
            else:
                self._add_listed(k, e, is_dir)

    def _gone(self, inode: Inode) -> None:
        pino = self.by_key.get(parent_key(inode.key))
        name = inode.key.rpartition("/")[2]
        self._forget_child(inode)
        if pino is not None:
            self.notify.entry(pino, name)
            parent = self.inodes.get(pino)
            if parent is not None:
                parent.mtime_ns = time.time_ns()

    def _add_listed(self, key: str, e: dict[str, Any], is_dir: bool) -> None:
        """Put a new entry into its parent's listing, if we have that listing."""
        parent = self._parent_of(key)
        if parent is None or parent.children is None:
            return  # a lookup will find it in the entries
        inode = self._inode_for(key, e if (e["t"] == DIR) == is_dir else None, is_dir)
        name = key.rpartition("/")[2]
        parent.children[name] = inode.ino
        self.notify.entry(parent.ino, name)

    # -- flushing through the cluster -----------------------------------------------------

    async def flush_open_files(self) -> None:
        """Commit what files still open here have written (before a drain)."""
        with first_error():
            async with trio.open_nursery() as n:
                for h in list(self.handles.values()):
                    if h.lf is not None and h.lf.dirty:
                        n.start_soon(self._commit_content, h.inode, h.lf)
