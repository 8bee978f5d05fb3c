"""Sealed dirty blobs: the closed, not yet uploaded versions of files, by content id.

When a file is closed on a node, its content becomes an immutable blob `<cid>` in
CACHE_DIR/dirty (a hard link to the working copy, so sealing copies nothing; the working
copy is unshared before it is written again), and the other holders pull a copy from us
before the close returns: that is the replication that makes a closed file outlive its
node. Blobs are named by content id, not by path, so a rename moves no data. A blob goes
when no namespace entry refers to it any more (after upload, overwrite or unlink).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from objcache.errors import NoSpace, NotFound

log = logging.getLogger(__name__)

PIECE = 8 << 20  # bytes per pull request
PULL_PARALLEL = 4
KEEP_UNREFERENCED = 120.0  # seconds a blob may wait for the commit that refers to it

# (offset, length) -> bytes, reading the blob from a holder
Reader = Callable[[int, int], Awaitable[bytes]]


class DirtyStore:
    def __init__(self, root: Path, charge: Callable[[int], bool],
                 release: Callable[[int], None]) -> None:
        self.root = root / "dirty"
        self.root.mkdir(parents=True, exist_ok=True)
        self._charge = charge
        self._release = release
        self.sizes: dict[str, int] = {}
        self.born: dict[str, float] = {}  # cid -> when it appeared (unreferenced grace)
        self.committed: set[str] = set()  # seen referenced by an entry: no grace once not
        self.io = trio.CapacityLimiter(8)  # file copies and fsyncs off the trio thread
        for f in self.root.iterdir():
            if f.name.endswith(".part"):
                f.unlink()
                continue
            size = f.stat().st_size
            self.sizes[f.name] = size
            self.born[f.name] = time.monotonic()
            charge(size)
        if self.sizes:
            log.info("found %d dirty blobs (%d bytes) in the cache dir", len(self.sizes),
                     sum(self.sizes.values()))

    def path(self, cid: str) -> str:
        if "/" in cid or cid.startswith("."):
            raise ValueError(f"bad content id {cid!r}")
        return str(self.root / cid)

    def has(self, cid: str) -> bool:
        return cid in self.sizes

    def seal(self, cid: str, working_copy: str, size: int) -> None:
        """Make the working copy's current content blob `cid` (a hard link: no copy)."""
        os.link(working_copy, self.path(cid))
        self._add(cid, size)

    def _add(self, cid: str, size: int) -> None:
        if not self._charge(size):
            os.unlink(self.path(cid))
            raise NoSpace(f"no room for a {size}-byte dirty copy in the cache")
        self.sizes[cid] = size
        self.born[cid] = time.monotonic()

    async def read(self, cid: str, offset: int, length: int) -> bytes:
        if cid not in self.sizes:
            raise NotFound(f"blob {cid} is not held here")

        def fn() -> bytes:
            with open(self.path(cid), "rb") as f:
                return os.pread(f.fileno(), length, offset)

        return await trio.to_thread.run_sync(fn, limiter=self.io)

    async def pull(self, cid: str, size: int, reader: Reader) -> None:
        """Copy blob `cid` from a holder (`reader`), durably, unless we hold it already."""
        if cid in self.sizes:
            return
        part = self.path(cid) + f".{os.getpid()}.{id(reader)}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            limiter = trio.CapacityLimiter(PULL_PARALLEL)

            async def piece(off: int) -> None:
                async with limiter:
                    n = min(PIECE, size - off)
                    data = await reader(off, n)
                    if len(data) != n:
                        raise NotFound(f"blob {cid}: holder sent {len(data)} of {n} bytes")
                    await trio.to_thread.run_sync(os.pwrite, fd, data, off, limiter=self.io)

            async with trio.open_nursery() as nursery:
                for off in range(0, size, PIECE):
                    nursery.start_soon(piece, off)
            await trio.to_thread.run_sync(os.fsync, fd, limiter=self.io)
        except BaseException:
            os.close(fd)
            os.unlink(part)
            raise
        os.close(fd)
        if cid in self.sizes:  # pulled twice at once
            os.unlink(part)
            return
        os.rename(part, self.path(cid))
        self._add(cid, size)

    def drop(self, cid: str) -> None:
        size = self.sizes.pop(cid, None)
        self.born.pop(cid, None)
        self.committed.discard(cid)
        if size is None:
            return
        try:
            os.unlink(self.path(cid))
        except FileNotFoundError:
            pass
        self._release(size)

    def gc(self, referenced: set[str]) -> int:
        """Drop blobs nothing refers to (after a grace period for ones being committed)."""
        now = time.monotonic()
        n = 0
        self.committed |= referenced & self.sizes.keys()
        for cid in list(self.sizes):
            if cid not in referenced and (cid in self.committed or
                                          now - self.born.get(cid, 0) > KEEP_UNREFERENCED):
                self.drop(cid)
                n += 1
        return n
