"""The single-node write-back loop: uploads dirty local files to S3 after the delay.

A file is due when nobody has it open for writing and it has not changed for
`writeback_delay` seconds, or at once when fsync/flush/umount asks, or when dirty data
crowds the cache (ChunkCache.crowded: above 80%, or a writer waits for room). Large
files go up as parallel multipart uploads. A file written front to back from empty is
streamed (objcache.backend.streaming): its complete parts go up while it is being written,
and it is due as soon as it is closed.
The dirty mark is cleared only if the file did not change while it was uploading, so a
write racing an upload is never lost. A file S3 refuses for good (objcache.cache.quarantine)
goes to the quarantine after a few refusals, at once when a flush, umount or drain asks, so
that these always finish; the flush then fails naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from objcache.backend.streaming import Streams
from objcache.cache.localfiles import LocalFile, LocalFiles
from objcache.cache.quarantine import Quarantine
from objcache.config import MountConfig
from objcache.entries import FlushScope
from objcache.errors import ObjcacheError, StoreError, StoreRefused, first_error
from objcache.store import ObjectStore
from objcache.store.meta import make_meta
from objcache.ticks import next_tick

log = logging.getLogger(__name__)

# A failed upload is retried after the write-back delay, but at least 0.5 s and at most
# 10 s after the failure.
RETRY_AFTER_FAILURE = 10.0


def retry_after(writeback_delay: float) -> float:
    return min(RETRY_AFTER_FAILURE, max(0.5, writeback_delay))


class Writeback:
    def __init__(self, cfg: MountConfig, store: ObjectStore, local: LocalFiles,
                 quarantine: Quarantine, on_uploaded: Callable[[LocalFile], None],
                 on_quarantined: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.store = store
        self.local = local
        self.quarantine = quarantine
        self.on_uploaded = on_uploaded
        self.on_quarantined = on_quarantined  # the key no longer has a dirty file
        self.uploads = trio.CapacityLimiter(4)  # files in flight (parts run in parallel)
        self.streams = Streams(store, local, local.cs)
        self.retry_after = retry_after(cfg.writeback_delay)
        self._failed_at: dict[int, float] = {}
        self._running: set[int] = set()
        self.uploaded_files = 0
        self.failed_uploads = 0

    def _due(self, lf: LocalFile, now: float, pressure: bool) -> bool:
        if not lf.dirty or lf.fid in self._running or lf.removed:
            return False
        if now - self._failed_at.get(lf.fid, -1e9) < self.retry_after:
            return False
        if lf.urgent:
            return True
        if self.streams.active(lf) and not lf.writers:
            return True  # written front to back and closed: finish what is streaming
        if lf.writers:
            return False
        return pressure or now - lf.last_change >= self.cfg.writeback_delay

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                self.local.changed = trio.Event()
                now = time.monotonic()
                pressure = self.local.space.crowded
                self.streams.sweep()
                for lf in list(self.local.dirty_files()):
                    if lf.writers and not lf.removed:
                        self.streams.poll(lf, nursery)
                    if self._due(lf, now, pressure):
                        self._running.add(lf.fid)
                        nursery.start_soon(self._background_upload, lf)
                with trio.move_on_at(next_tick(min(1.0, max(0.05, self.cfg.writeback_delay / 4)))):
                    await self.local.changed.wait()

    async def _background_upload(self, lf: LocalFile) -> None:
        try:
            async with self.uploads:
                await self.upload(lf, raise_errors=False)
        except Exception:  # never let one file take the flusher down
            self._failed_at[lf.fid] = time.monotonic()
            log.exception("unexpected error uploading %r", lf.key)
        finally:
            self._running.discard(lf.fid)

    async def upload(self, lf: LocalFile, raise_errors: bool) -> None:
        """Upload `lf` if it is dirty; with raise_errors, failures propagate."""
        async with lf.lock:
            self.local.observe(lf)  # (writes the kernel made without us, if any)
            if not lf.dirty or lf.removed:
                return
            version = lf.version
            key = lf.key
            started = time.monotonic()
            try:
                await self.local.materialize_all(lf)
                etag = await self.streams.finish(lf)
                if etag is None:
                    meta = make_meta(lf.attrs)
                    etag = await self.store.put_file(key, lf.path, lf.size, meta,
                                                     self.local.cs)
            except StoreRefused as e:
                self.failed_uploads += 1
                self._failed_at[lf.fid] = time.monotonic()
                if raise_errors or self.quarantine.refused(key):
                    await self._quarantine(lf, str(e))
                    return
                log.error("S3 refused %r (retried in %gs, then quarantined): %s", key,
                          self.retry_after, e)
                return
            except ObjcacheError as e:
                self.failed_uploads += 1
                self._failed_at[lf.fid] = time.monotonic()
                log.error("upload of %r failed (it stays dirty and will be retried): %s",
                          key, e)
                if raise_errors:
                    raise
                return
            self._failed_at.pop(lf.fid, None)
            self.quarantine.forgive(key)
            self.local.observe(lf)  # written through a mapping while it went up?
            if lf.version == version and not lf.removed and lf.key == key:
                self.local.mark_clean(lf, etag)
                self.uploaded_files += 1
                self.on_uploaded(lf)
                log.debug("uploaded %r (%d bytes) in %.2fs", key, lf.size,
                          time.monotonic() - started)
            else:
                log.debug("%r changed while uploading; it stays dirty", key)

    async def _quarantine(self, lf: LocalFile, error: str) -> None:
        """Move a refused file's bytes to the quarantine and forget it (the caller holds
        its lock): the name shows S3's version again, if there is one."""
        key = lf.key

        async def drop() -> None:
            self.local.remove(lf)
            self.on_quarantined(key)

        await self.quarantine.put(key, lf.path, lf.size, error, drop)

    async def flush(self, scope: FlushScope, deadline: float | None = None) -> int:
        """Return once nothing dirty is left in `scope` ("mine" is everything: one node
        owns it all); how many files were uploaded. Raises StoreError if an upload
        fails, or, once everything else is up, naming what S3 refused and the flush
        quarantined."""
        done: set[int] = set()
        seen = self.quarantine.count
        while True:
            todo = [lf for lf in self.local.dirty_files()
                    if scope.kind == "mine" or scope.covers(lf.key)]
            if not todo:
                self.quarantine.raise_if_refused(
                    seen, lambda k: scope.kind == "mine" or scope.covers(k))
                return len(done)
            done |= {lf.fid for lf in todo}
            if deadline is not None and time.monotonic() > deadline:
                raise StoreError(f"{len(todo)} files are still dirty after the flush timeout")
            for lf in todo:
                lf.urgent = True
                self._failed_at.pop(lf.fid, None)
            with first_error():
                async with trio.open_nursery() as n:
                    for lf in todo:
                        n.start_soon(self._flush_one, lf)

    async def _flush_one(self, lf: LocalFile) -> None:
        async with self.uploads:
            await self.upload(lf, raise_errors=True)
