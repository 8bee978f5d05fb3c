"""Open files: where a handle's bytes come from is a property of the handle.

- `ObjectSource`: one S3 object version (a clean file, or the object a renamed file still
  reads), through the chunk cache and its owners, with sequential readahead;
- `BlobSource`: a closed, not yet uploaded file in a cluster, from a node holding its blob;
- `EMPTY`: nothing (an empty file, a symlink's entry);
- a working copy (objcache.cache.localfiles), once the handle or another one on this node
  wrote: the core reads those first.

A read-only handle keeps the version it opened (like NFS): a later close elsewhere is seen
by the next open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from objcache.entries import FileEntry, ObjectRef
from objcache.errors import NotFound, PeerError, StaleObject

if TYPE_CHECKING:
    from objcache.backend.base import Backend
    from objcache.cache.localfiles import LocalFile
    from objcache.cache.router import ChunkRouter
    from objcache.core.inode import Inode


class Source(Protocol):
    """`read` returns bytes the caller uses before it next awaits (a FUSE reply is
    sent at once): they may be a view of a buffer that is reused later."""

    size: int

    async def read(self, offset: int, length: int) -> bytes | bytearray | memoryview: ...


class _Empty:
    size = 0

    async def read(self, offset: int, length: int) -> bytes:
        return b""


EMPTY = _Empty()


class ObjectSource:
    """An S3 object version. A reader near where its reads have got to (or at 0) is
    sequential: the next chunks are started before waiting for this one, so a cold reader
    has the readahead window in flight from its first read. "Near" is within a chunk
    either way: the kernel's readahead sends several requests at once, which arrive out of
    order, and an mmap reader faulting pages in tensor order skips the gaps between
    tensors; a reader that jumps further is random and starts nothing ahead."""

    def __init__(self, router: ChunkRouter, ref: ObjectRef, readahead_chunks: int) -> None:
        self.router = router
        self.ref = ref
        self.size = ref.size
        self.readahead_chunks = readahead_chunks
        self.next_offset = -1

    async def read(self, offset: int, length: int) -> bytes | bytearray | memoryview:
        ref = self.ref
        if offset >= ref.size:
            return b""
        cs = self.router.chunk_size
        if offset == 0 or abs(offset - self.next_offset) <= cs:
            self.router.readahead(ref.key, ref.etag, ref.size, offset // cs + 1,
                                  self.readahead_chunks)
        data = await self.router.read(ref.key, ref.etag, ref.size, offset, length,
                                      volatile=True)
        self.next_offset = offset + len(data)
        return data


class BlobSource:
    """A closed file's sealed blob (an entry with `cid`). If the blob was written back and
    dropped while we read, S3 holds the same bytes: `uploaded` reads them there."""

    def __init__(self, backend: Backend, entry: FileEntry, inode: Inode,
                 router: ChunkRouter) -> None:
        self.backend = backend
        self.entry = entry
        self.size = entry.size
        self.inode = inode
        self.router = router

    async def read(self, offset: int, length: int) -> bytes:
        n = min(length, self.size - offset)
        if n <= 0:
            return b""
        try:
            return await self.backend.read_blob(self.entry, offset, n)
        except (PeerError, NotFound):
            inode = self.inode
            if inode.detached or (inode.overlay is not self.entry
                                  and inode.overlay is not None):
                # Replaced since it was opened, and its blob is gone: never other bytes.
                raise StaleObject(f"{inode.key}: replaced while open") from None
            if inode.overlay is not None or not inode.etag:
                raise
            return await self.router.read(inode.key, inode.etag, self.size, offset, n)


@dataclass(slots=True)
class FileHandle:
    """An open file: its inode, whether it may write, where its bytes come from, the
    working copy it writes (made on the first write or O_TRUNC), and whether the kernel
    serves it from the inode's backing file (passthrough: its reads and writes never
    reach us). `mappable`: opened for reading and writing, the only open a shared
    writable mapping can be made from (mmap(2): EACCES otherwise)."""

    inode: Inode
    writable: bool
    source: Source
    lf: LocalFile | None = None
    backed: bool = False
    mappable: bool = False
