"""The single-node backend: namespace changes go to S3 at once, file data through the
local journal and the write-back loop.

mkdir, unlink, rmdir, symlink and attribute changes of clean files reach S3 before the
call returns (a marker PUT, a DELETE, a server-side copy with new metadata). Written files
live in working copies (objcache.cache.localfiles), journaled before each close returns,
and objcache.backend.writeback uploads them after `--writeback-delay`. A rename moves S3
objects server-side (copy, then delete) and re-keys working copies; a directory rename
moves every object under it, in parallel, and is not atomic in the bucket.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import trio

from objcache.backend.base import NO_VIEW, AttrsOf, Change, Moved, NsView, Stats
from objcache.backend.writeback import Writeback
from objcache.cache.localfiles import LocalFile, LocalFiles
from objcache.cache.quarantine import Quarantine
from objcache.entries import Attrs, DirEntry, FileEntry, FlushScope, ObjectRef
from objcache.errors import NotFound, first_error
from objcache.store.meta import make_meta

if TYPE_CHECKING:
    from objcache.config import MountConfig
    from objcache.store import ObjectStore

log = logging.getLogger(__name__)

COPY_PARALLEL = 16


class LocalBackend:
    def __init__(self, cfg: MountConfig, store: ObjectStore, local: LocalFiles,
                 quarantine: Quarantine) -> None:
        self.store = store
        self.sync_is_local = True  # one node: a catch-up waits for nobody
        self.local = local
        self.writeback = Writeback(cfg, store, local, quarantine, self._uploaded,
                                   self._quarantined)
        self._changes: deque[Change] = deque()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        await self.writeback.run()

    # -- what is known beyond S3: only working copies, which the core holds -----------------

    def entry(self, key: str) -> FileEntry | DirEntry | None:
        return None

    def live_under(self, prefix: str) -> bool:
        return False

    def view_under(self, prefix: str) -> NsView:
        return NO_VIEW

    async def sync(self) -> bool:
        return False  # S3 and this node are all there is

    def _uploaded(self, lf: LocalFile) -> None:
        assert lf.etag is not None
        self._changes.append(Change(lf.key, None, ObjectRef(lf.key, lf.etag, lf.size)))
        self._changed.set()

    def _quarantined(self, key: str) -> None:
        self._changes.append(Change(key, None, None))  # the name shows S3's version again
        self._changed.set()

    def take_changes(self) -> list[Change]:
        out = list(self._changes)
        self._changes.clear()
        return out

    async def wait_changes(self) -> None:
        while not self._changes:
            self._changed = trio.Event()
            await self._changed.wait()

    # -- namespace changes ------------------------------------------------------------------

    async def create(self, key: str, attrs: Attrs, excl: bool) -> FileEntry | None:
        return None  # the dirty working copy is the record until it is uploaded

    async def mkdir(self, key: str, attrs: Attrs) -> DirEntry | None:
        await self.store.put_bytes(key + "/", b"", make_meta(attrs))
        return None

    async def make_node(self, key: str, attrs: Attrs, body: bytes) -> FileEntry | ObjectRef:
        etag = await self.store.put_bytes(key, body, make_meta(attrs))
        return ObjectRef(key, etag, len(body))

    async def unlink(self, key: str, maybe_in_s3: bool) -> None:
        if maybe_in_s3:
            await self.store.delete(key)

    async def rmdir(self, key: str, maybe_in_s3: bool) -> None:
        await self.store.delete(key + "/")

    async def set_dir_attrs(self, key: str, attrs: Attrs) -> DirEntry | None:
        await self.store.put_bytes(key + "/", b"", make_meta(attrs))
        return None

    async def set_file_attrs(self, key: str, current: FileEntry | ObjectRef, attrs: Attrs
                             ) -> FileEntry | ObjectRef:
        assert isinstance(current, ObjectRef)  # one node keeps no entries
        etag = await self.store.copy(key, key, make_meta(attrs))
        return ObjectRef(key, etag, current.size)

    async def rename(self, src: str, dst: str, is_dir: bool, replaces_dir: bool,
                     noreplace: bool, dir_attrs: Attrs | None, attrs_of: AttrsOf
                     ) -> list[Moved]:
        # What was at the destination goes first: its marker, or its working copy (never
        # while it uploads, or the upload would land over the moved object).
        if replaces_dir:
            await self.store.delete(dst + "/")
        else:
            dlf = self.local.by_key.get(dst)
            if dlf is not None:
                async with dlf.lock:
                    self.local.remove(dlf)
        if is_dir:
            return await self._rename_dir(src, dst, dir_attrs, attrs_of)
        # The renamed file's metadata is rewritten with its new ctime, when we know it
        # (otherwise the copy keeps what the object has).
        a = attrs_of(src)
        moved = await self._rename_object(src, dst, None, make_meta(a) if a else None)
        return [moved] if moved is not None else []

    async def _rename_object(self, old: str, new: str, old_etag: str | None,
                             meta: dict[str, str] | None = None) -> Moved | None:
        """Move one file or symlink: server-side copy + delete in S3, re-key its working
        copy. A working copy never uploaded has no object to move."""
        lf = self.local.by_key.get(old)
        async with AsyncExitStack() as stack:
            if lf is not None:
                await stack.enter_async_context(lf.lock)
            moved = None
            if lf is None or lf.etag is not None:
                etag = await self.store.copy(old, new, meta)
                await self.store.delete(old)
                moved = Moved(old, old_etag, new, etag)
                if lf is not None:
                    if lf.base_key == old:
                        lf.base_key, lf.base_etag = new, etag
                    if not lf.dirty:
                        lf.etag = etag
            if lf is not None:
                self.local.rekey(lf, new)
            return moved

    async def _rename_dir(self, src: str, dst: str, attrs: Attrs | None,
                          attrs_of: AttrsOf) -> list[Moved]:
        """Move every object under the directory (not atomic: see docs/semantics.md)."""
        old_prefix, new_prefix = src + "/", dst + "/"
        objs = {o.key: o.etag async for o in self.store.list_recursive(old_prefix)}
        local_keys = {k for k in self.local.by_key if k.startswith(old_prefix)}
        limiter = trio.CapacityLimiter(COPY_PARALLEL)
        moved: list[Moved] = []

        async def move(key: str) -> None:
            async with limiter:
                dest = new_prefix + key[len(old_prefix):]
                if key.endswith("/"):
                    # A marker carries no data; some servers (SeaweedFS) cannot copy one.
                    # A subdirectory whose attributes we never HEADed gets the moved
                    # directory's.
                    a = (None if key == old_prefix else attrs_of(key)) or attrs
                    await self.store.put_bytes(dest, b"", make_meta(a) if a else {})
                    await self.store.delete(key)
                    return
                m = await self._rename_object(key, dest, objs.get(key))
                if m is not None:
                    moved.append(m)

        with first_error():
            async with trio.open_nursery() as n:
                for key in sorted(objs.keys() | local_keys):
                    n.start_soon(move, key)
        if not objs and not local_keys and attrs is not None:
            # An empty directory without a marker only existed in our memory: give it one.
            await self.store.put_bytes(new_prefix, b"", make_meta(attrs))
        return moved

    # -- working copies -----------------------------------------------------------------------

    async def working_attrs_changed(self, lf: LocalFile) -> ObjectRef | None:
        if lf.dirty:
            self.local.save(lf)  # uploaded with the data
            return None
        # A clean copy of an S3 object: rewrite the object's metadata server-side.
        async with lf.lock:
            etag = await self.store.copy(lf.key, lf.key, make_meta(
                lf.attrs))
            lf.etag = etag
            self.local.save(lf)
        return ObjectRef(lf.key, etag, lf.size)

    async def close(self, key: str, lf: LocalFile, final: bool = False
                    ) -> FileEntry | None:
        """Journal size and mtime, so a crash after close() loses nothing; the write-back
        loop uploads it later."""
        self.local.save(lf)
        self.local.changed.set()
        return None

    async def fsync(self, key: str, lf: LocalFile) -> FileEntry | ObjectRef | None:
        """Upload the file before returning."""
        self.local.save(lf)
        await self.writeback.upload(lf, raise_errors=True)
        if lf.dirty or lf.etag is None:
            return None  # written again while it uploaded: still dirty
        return ObjectRef(lf.key, lf.etag, lf.size)

    def released(self, lf: LocalFile) -> None:
        pass  # a clean working copy stays as cached data (the cache may evict it)

    async def read_blob(self, e: FileEntry, offset: int, length: int) -> bytes:
        raise NotFound("a single node keeps no blobs")

    # -- write-back ---------------------------------------------------------------------------

    async def flush(self, scope: FlushScope) -> int:
        return await self.writeback.flush(scope)

    async def drain(self) -> int:
        return await self.writeback.flush(FlushScope.everything())

    def stats(self) -> Stats:
        files, nbytes, oldest = self.local.dirty_summary()
        streams = self.writeback.streams
        return Stats(files, nbytes, oldest, self.writeback.uploaded_files,
                     self.writeback.failed_uploads, streams.streamed_files, streams.fallbacks,
                     self.writeback.quarantine.count)
