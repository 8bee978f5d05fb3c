"""Passthrough opens: which open files the kernel serves from a file on our disk.

An open whose bytes are all on this node (a complete working copy, or a whole cached object
version) can be answered with a backing file: the kernel then reads, writes and maps it
without crossing into the daemon. The kernel's rules (../shared/reference/
fuse-passthrough.md, Linux fs/fuse/iomode.c) decide the shape of this module:

- one backing file per inode while it has passthrough opens: every further open of it
  shares that backing (`Backed`), which is given up after the last release;
- no mix: while an inode has daemon-served opens, its new opens are daemon-served too,
  and the other way round (the kernel fails a mixed open with EIO);
- the backing file of an inode is the file any writer of it writes: a working copy
  (objcache.cache.localfiles), or a cached object version that becomes one when a writer
  comes (objcache.cache.chunks: `ChunkCache.hand_over`).

Whether the kernel takes backing files at all is the FUSE layer's business (`Backing`); a
refusal is logged once and the opens are served by the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from objcache.cache.chunks import ObjFile
    from objcache.cache.localfiles import LocalFile

log = logging.getLogger(__name__)


class Backing(Protocol):
    """Registers backing files with the kernel (objcache.fs.operations.SessionBacking)."""

    @property
    def available(self) -> bool: ...

    @property
    def why_not(self) -> str: ...

    def open(self, fd: int) -> int: ...

    def close(self, backing_id: int) -> None: ...


class NoBacking:
    """No kernel to pass through to (the core driven without FUSE)."""

    available = False
    why_not = "no FUSE session"

    def open(self, fd: int) -> int:
        raise OSError(errno.ENOTSUP, "no FUSE session")

    def close(self, backing_id: int) -> None:
        pass


NO_BACKING = NoBacking()


@dataclass(slots=True, eq=False)
class Backed:
    """An inode's backing file while it has passthrough opens.

    id: the kernel's backing id; file: (st_dev, st_ino) of the file registered;
    opens: handles using it; lf: the working copy it is, if it is one; obj: else the
    cached object version's file it is (held in the chunk cache while it is a backing
    file).
    """

    id: int
    path: str
    file: tuple[int, int]
    opens: int = 0
    lf: LocalFile | None = None
    obj: ObjFile | None = None


def writer_headroom(capacity: int) -> int:
    """Free cache budget a new writer needs to be passed through. Its writes are counted
    only when they are seen (every 0.2 s: about 280 MB at this machine's 1.4 GB/s, and at
    close) and cannot be made to wait for write-back: with less room than this (256 MiB,
    or a quarter of the cache), a writer is served by the daemon, which holds it back
    when the cache fills."""
    return max(256 << 20, capacity // 4)


# Backing ids kept registered after their last open is released, so that reopening the
# same file costs no open(2) and no two ioctls (a warm pass over small files reopens each).
IDLE_BACKINGS = 256


class Passthrough:
    """Registers and releases backing files; counts what it did for status."""

    def __init__(self, backing: Backing) -> None:
        self.backing = backing
        self.refused = ""  # why the kernel refused a backing file (logged once)
        self.opens = 0  # opens answered with a backing file
        self.daemon_opens = 0  # opens served by the daemon
        self.read_bytes = 0  # file bytes the daemon read for the kernel ...
        self.written_bytes = 0  # ... and wrote (what passthrough spares it)
        self._idle: OrderedDict[str, tuple[int, tuple[int, int]]] = OrderedDict()

    @property
    def available(self) -> bool:
        return self.backing.available and not self.refused

    def mode(self) -> str:
        """`passthrough` or why not, for status and the log."""
        if self.available:
            return "passthrough"
        return f"daemon ({self.refused or self.backing.why_not})"

    def register(self, path: str) -> Backed | None:
        """A backing file for `path` (one kept from an earlier open of that very file, or
        a new registration), or None (logged once) if the kernel refuses it."""
        try:
            st = os.stat(path)
        except OSError as e:
            log.info("no passthrough for %s: %s", path, e)
            return None
        file = (st.st_dev, st.st_ino)
        idle = self._idle.pop(path, None)
        if idle is not None:
            if idle[1] == file:
                return Backed(idle[0], path, file)
            self._close(idle[0])  # (another file now has that name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            log.info("no passthrough for %s: %s", path, e)
            return None
        try:
            backing_id = self.backing.open(fd)
        except OSError as e:
            if not self.refused:
                log.warning("the kernel refused a passthrough backing file (%s): opens are "
                            "served by the daemon from now on", e.strerror or e)
            self.refused = f"the kernel refused a backing file: {e.strerror or e}"
            return None
        finally:
            os.close(fd)  # (the kernel holds its own reference)
        return Backed(backing_id, path, file)

    def release(self, b: Backed) -> None:
        """Its last open is released: the id is kept for a while, for the next open (not
        if its file went meanwhile: the registration would keep the file's space)."""
        old = self._idle.pop(b.path, None)
        if old is not None and old[0] != b.id:
            self._close(old[0])
        try:
            st = os.stat(b.path)
            still = (st.st_dev, st.st_ino) == b.file
        except OSError:
            still = False
        if not still:
            self._close(b.id)
            return
        self._idle[b.path] = (b.id, b.file)
        while len(self._idle) > IDLE_BACKINGS:
            self._close(self._idle.popitem(last=False)[1][0])

    def forget(self, path: str) -> None:
        """`path` will not be a backing file again as it is (removed, evicted, rewritten
        behind the kernel's back): its idle id goes."""
        idle = self._idle.pop(path, None)
        if idle is not None:
            self._close(idle[0])

    def _close(self, backing_id: int) -> None:
        try:
            self.backing.close(backing_id)
        except OSError as e:
            log.info("closing backing id %d failed: %s", backing_id, e)


NO_PASSTHROUGH = Passthrough(NO_BACKING)
