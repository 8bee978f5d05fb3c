"""Streaming write-back for sequential writers (gcsfuse calls these streaming writes).

A file written from empty, front to back, starts a multipart upload as soon as its first
part is complete. Complete parts go up while the writer goes on, and the write-back of the
closed file sends only the rest and completes the upload. Part sizes follow
objcache.store.parts (they grow, so 10,000 parts cover more than 1 TiB).

Bytes handed to a part are sealed (LocalFile.sealed). A write or truncate below the seal, a
rename, a chmod/chown or a failed part breaks the stream: its upload is aborted and the
file goes up whole, like any other. A stream never completes an object by itself; only the
write-back of a closed (or fsynced) file does. So an unclosed file never appears in S3, and
a crash leaves only an incomplete multipart upload, which the restarted daemon does not
know about (a bucket lifecycle rule, AbortIncompleteMultipartUpload, removes such parts).

Writes through passthrough (objcache.core.passthrough) never reach us, so for a file
written that way a write below the seal cannot be seen as it happens: each part's digest
is taken before the part is read for upload, and the stream is used at the end only if
every part's bytes still match their digest.

Streamed objects carry mode, uid and gid but no mtime: metadata is fixed when the upload
starts, before the last write, so S3's LastModified (the completion time) stands in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from objcache.cache.localfiles import LocalFile, LocalFiles
from objcache.entries import Attrs
from objcache.errors import ObjcacheError, first_error
from objcache.store import ObjectStore
from objcache.store.meta import make_meta
from objcache.store.parts import MAX_PARTS, part_ranges, part_start

log = logging.getLogger(__name__)

ABORT_SECONDS = 10.0  # an abort on shutdown gets this long; the lifecycle rule does the rest


@dataclass(eq=False)
class Stream:
    lf: LocalFile
    key: str
    attrs: tuple[int, int, int]
    upload_id: str = ""
    etags: dict[int, str] = field(default_factory=dict)
    next_part: int = 1
    sent_end: int = 0  # end of the bytes handed to parts
    failed: bool = False
    finishing: bool = False
    # part number -> (start, length, digest) of parts of a file written without us
    digests: dict[int, tuple[int, int, bytes]] = field(default_factory=dict)
    wake: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)

    def broken(self) -> bool:
        lf = self.lf
        return (self.failed or lf.seal_broken or lf.removed or lf.key != self.key
                or (lf.mode, lf.uid, lf.gid) != self.attrs or lf.size < self.sent_end)


class Streams:
    """The streams of the files being written; driven by the write-back loop.

    parallel: parts of one file in flight while its writer goes on (the writer and the
        upload share the node's cores and disk).
    """

    def __init__(self, store: ObjectStore, local: LocalFiles, part_base: int,
                 parallel: int = 2) -> None:
        self.store = store
        self.local = local
        self.part_base = part_base
        self.parallel = parallel
        self._by_fid: dict[int, Stream] = {}
        self.streamed_files = 0
        self.streamed_parts = 0
        self.fallbacks = 0

    def active(self, lf: LocalFile) -> bool:
        return lf.fid in self._by_fid

    def poll(self, lf: LocalFile, nursery: trio.Nursery) -> None:
        """The write-back loop saw `lf` dirty: start a stream for it or wake its driver."""
        st = self._by_fid.get(lf.fid)
        if st is not None:
            st.wake.set()
        elif (lf.writers and not lf.removed and lf.base_key is None and not lf.base_limit
              and not lf.shared and lf.size >= part_start(self.part_base, 2)):
            st = Stream(lf, lf.key, (lf.mode, lf.uid, lf.gid))
            lf.sealed, lf.seal_broken = 0, False
            self._by_fid[lf.fid] = st
            nursery.start_soon(self._drive, st)

    def sweep(self) -> None:
        """Drop the streams of removed files (nothing will ever upload them)."""
        for fid, st in list(self._by_fid.items()):
            if st.lf.removed:
                del self._by_fid[fid]
                st.finishing = True
                st.wake.set()

    async def _drive(self, st: Stream) -> None:
        lf = st.lf
        try:
            meta = make_meta(Attrs(lf.mode, lf.uid, lf.gid, 0))
            for t in ("mtime", "atime", "ctime"):  # not known before close: LastModified
                del meta[t]
            st.upload_id = await self.store.start_upload(st.key, meta)
            limiter = trio.CapacityLimiter(self.parallel)
            async with trio.open_nursery() as nursery:
                while not st.broken():
                    # every complete part, but never the last one S3 allows: the write-back
                    # of the closed file sends what is left as the final parts
                    while st.next_part < MAX_PARTS:
                        end = part_start(self.part_base, st.next_part + 1)
                        if lf.size < end:
                            break
                        lf.sealed = end  # before any byte of it is read
                        nursery.start_soon(self._part, st, st.next_part, st.sent_end,
                                           end - st.sent_end, limiter)
                        st.next_part += 1
                        st.sent_end = end
                    if st.finishing:
                        break
                    await st.wake.wait()
                    st.wake = trio.Event()
        except ObjcacheError as e:
            st.failed = True
            log.info("streaming upload of %r stopped (%s); it will go up whole", st.key, e)
        finally:
            st.ended.set()
            if st.upload_id and (st.broken() or not st.finishing):
                await self._abort(st)  # broken, or the daemon is shutting down

    async def _part(self, st: Stream, number: int, start: int, length: int,
                    limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            if st.broken():
                return
            try:
                if self.local.bypassed(st.lf):  # (taken before the part is read to send)
                    st.digests[number] = (start, length,
                                          await self.local.digest(st.lf, start, length))
                st.etags[number] = await self.store.put_part(st.key, st.upload_id, number,
                                                             st.lf.path, start, length)
                self.streamed_parts += 1
            except ObjcacheError as e:
                st.failed = True
                log.info("part %d of %r failed (%s); the file will go up whole", number,
                         st.key, e)

    async def finish(self, lf: LocalFile) -> str | None:
        """Complete `lf`'s stream with the bytes not sent yet: the object's ETag, or None
        when there is no usable stream (the caller uploads the whole file). Raises
        ObjcacheError when the final parts or the completion fail (the stream is gone; the
        retry uploads the whole file)."""
        st = self._by_fid.pop(lf.fid, None)
        if st is None:
            return None
        st.finishing = True
        st.wake.set()
        try:
            await st.ended.wait()  # no part in flight any more
            for start, length, digest in st.digests.values():
                if st.broken() or await self.local.digest(lf, start, length) != digest:
                    lf.seal_broken = True  # written below the seal, through passthrough
                    break
            if st.broken() or not st.upload_id:
                self.fallbacks += 1
                log.info("%r goes up whole: %s", st.key, "a part failed" if st.failed else
                         "it changed behind its streaming upload")
                return None
            limiter = trio.CapacityLimiter(8)

            async def part(number: int, start: int, length: int) -> None:
                async with limiter:
                    st.etags[number] = await self.store.put_part(
                        st.key, st.upload_id, number, lf.path, start, length)

            with first_error():
                async with trio.open_nursery() as nursery:
                    for number, start, length in part_ranges(self.part_base, lf.size,
                                                             st.next_part):
                        nursery.start_soon(part, number, start, length)
            etag = await self.store.finish_upload(st.key, st.upload_id, st.etags)
            st.upload_id = ""
            self.streamed_files += 1
            return etag
        finally:
            lf.sealed, lf.seal_broken = 0, False
            if st.upload_id:
                await self._abort(st)

    async def _abort(self, st: Stream) -> None:
        upload_id, st.upload_id = st.upload_id, ""
        with trio.CancelScope(shield=True), trio.move_on_after(ABORT_SECONDS):
            await self.store.abort_upload(st.key, upload_id)
