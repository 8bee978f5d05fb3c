"""The quarantine: files S3 refuses for good, kept in the cache dir instead of retried forever.

A write-back that S3 refuses with a permanent error (a 4xx other than throttling: a key the
server does not accept, a bucket policy, an object lock) is retried a few times; then the
file's bytes are moved to `lost+found/` in the cache dir, the file leaves the dirty set (its
name shows S3's version again), and a JSON note with its key, size, error and time is
written next to the bytes, last. Nothing is deleted: an operator copies the bytes back under
a name S3 accepts (see docs/operations.md). `status` and the metrics count what is there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from objcache.errors import StoreRefused

log = logging.getLogger(__name__)

# Refusals of one file before it is quarantined (in the background; a flush, umount or
# drain quarantines at the first refusal: it must finish).
REFUSALS_BEFORE_QUARANTINE = 3
PIECE = 8 << 20


@dataclass(frozen=True, slots=True)
class Quarantined:
    key: str
    path: str  # the bytes, in lost+found/
    error: str
    seq: int = 0  # `Quarantine.count` once it was counted (later ones have higher)


class Quarantine:
    """Attributes:
    dir: lost+found/ in the cache dir.
    count: files quarantined there (all time, as the directory shows).
    recent: what this daemon quarantined, latest last (the last 100; for flush replies
        and status).
    """

    def __init__(self, cache_dir: Path) -> None:
        self.dir = cache_dir / "lost+found"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = sum(1 for f in self.dir.iterdir() if f.name.endswith(".json"))
        self.recent: list[Quarantined] = []
        self._refusals: dict[str, int] = {}
        self.io = trio.CapacityLimiter(1)  # file copies and fsyncs off the trio thread

    def refused(self, key: str) -> bool:
        """Count one permanent refusal of `key`; whether it is due for quarantine."""
        n = self._refusals.get(key, 0) + 1
        self._refusals[key] = n
        return n >= REFUSALS_BEFORE_QUARANTINE

    def forgive(self, key: str) -> None:
        """`key` went up (or went away): its refusals no longer count."""
        self._refusals.pop(key, None)

    async def put(self, key: str, data_path: str | None, size: int, error: str,
                  drop: Callable[[], Awaitable[None]]) -> Quarantined:
        """Keep `size` bytes of `data_path` (None: a change without data, such as a
        refused delete) under lost+found/ (a hard link when possible, else a copy), then
        `drop` the name, then write the note."""
        base = self._base(key)
        target = str(base) if data_path is not None else ""

        def keep() -> None:
            if data_path is None:
                return
            try:
                os.link(data_path, target)
            except OSError:
                shutil.copyfile(data_path, target)
            if os.stat(target).st_size > size:  # a data file may be longer than the
                # file it held; (a truncate to the same size would still move the mtime of
                # a working copy the file may share: a change to commit)
                os.truncate(target, size)

        await trio.to_thread.run_sync(keep, limiter=self.io)
        return await self._drop_then_note(base, key, size, error, target, drop)

    async def put_pieces(self, key: str, size: int, error: str,
                         read: Callable[[int, int], Awaitable[bytes]],
                         drop: Callable[[], Awaitable[None]]) -> Quarantined:
        """The same for bytes read piece by piece (`read(offset, length)`), such as an S3
        object about to be deleted."""
        base = self._base(key)
        target = str(base)
        with open(target, "wb") as f:  # noqa: ASYNC230 - each write goes to a thread
            for off in range(0, size, PIECE):
                data = await read(off, min(PIECE, size - off))
                await trio.to_thread.run_sync(f.write, data, limiter=self.io)
        return await self._drop_then_note(base, key, size, error, target, drop)

    async def _drop_then_note(self, base: Path, key: str, size: int, error: str,
                              target: str, drop: Callable[[], Awaitable[None]]
                              ) -> Quarantined:
        """The note comes last, so that once it is there the drop is committed (a script
        that waits for the note sees S3's version when it opens the name). It is
        written even if the drop failed: the bytes are kept either way, and the file,
        still dirty, comes back here later."""
        try:
            await drop()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._note, base, key, size, error, target,
                                              limiter=self.io)
            kept = self._kept(key, target, size, error)
        return kept

    def _base(self, key: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[-120:] or "file"
        return self.dir / f"{stamp}-{time.monotonic_ns() % 10**9:09d}-{safe}"

    @staticmethod
    def _note(base: Path, key: str, size: int, error: str, target: str) -> None:
        note = {"key": key, "size": size, "error": error, "data": os.path.basename(target),
                "time": time.time()}
        tmp = str(base) + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(note, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, str(base) + ".json")

    def _kept(self, key: str, target: str, size: int, error: str) -> Quarantined:
        self.count += 1
        self._refusals.pop(key, None)
        q = Quarantined(key, target, error, self.count)
        self.recent = [*self.recent[-99:], q]
        log.error("S3 refused %r for good (%s): its %d bytes are in %s, not in S3",
                  key, error, size, target or "(no data)")
        return q

    def raise_if_refused(self, since: int, covers: Callable[[str], bool]) -> None:
        """After a flush: StoreRefused naming what it quarantined (those counted after
        `count` was `since`, in scope), so that the flush fails, but only after everything
        else went up. (By count, not by place in `recent`: once that held its 100, a
        flush's quarantine kept its length, and the flush passed.)"""
        refused = [q for q in self.recent if q.seq > since and covers(q.key)]
        if not refused:
            return
        keys = ", ".join(repr(q.key) for q in refused[:10])
        more = f" and {len(refused) - 10} more" if len(refused) > 10 else ""
        raise StoreRefused(f"S3 refused {len(refused)} file(s) for good; everything else is "
                         f"uploaded. Their bytes are in {self.dir}: {keys}{more}")
