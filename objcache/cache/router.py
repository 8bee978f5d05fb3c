"""Reading chunks wherever they live: this node's cache, or (in a cluster) the chunk's owner.

Every chunk has one owner (`Placement`, implemented by objcache.cluster.placement; on a
single node `LocalPlacement` owns everything). A read of a chunk we hold is a local read; a
chunk another node owns is read from it, and a chunk it cannot serve is fetched from S3
into our own cache instead. Readahead asks each owner to fetch its own chunks, all owners
at once; a remote chunk read more than once over is kept in the near-cache; prefetch
requests are split by owner and sent in parallel.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Protocol

import trio

from objcache.cache.chunks import SMALL_OBJECT, ChunkCache, ChunkId, PreviousOwners
from objcache.cache.pins import ChunkRef, Pins

if TYPE_CHECKING:
    from objcache.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

REMOTE_READS_KEPT = 4096  # chunks whose bytes read through peers we count (near-cache)


class Placement(PreviousOwners, Protocol):
    """Where chunks live in a cluster. Methods that talk to a peer return None when it
    could not answer, and the caller falls back to S3."""

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        """The node that owns a chunk, or None when it is this node."""
        ...

    async def read(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                   start: int, length: int) -> bytes | None: ...

    async def fetch(self, owner: str, key: str, etag: str, obj_size: int, idx: int
                    ) -> bytes | None:
        """The whole chunk from `owner` (which fetches it from S3 if it must)."""
        ...

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        """Ask `owner` to start fetching these chunks (readahead), without waiting."""
        ...

    async def ensure_remote(self, owner: str, items: list[ChunkRef], pin: bool
                            ) -> list[str] | None:
        """Have `owner` run Pins.ensure_local on these chunks and wait for its outcomes."""
        ...


class LocalPlacement:
    """A single node: every chunk is ours."""

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        return None

    async def read(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                   start: int, length: int) -> bytes | None:
        return None

    async def fetch(self, owner: str, key: str, etag: str, obj_size: int, idx: int
                    ) -> bytes | None:
        return None

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None:
        return None

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        pass

    async def ensure_remote(self, owner: str, items: list[ChunkRef], pin: bool
                            ) -> list[str] | None:
        return None


LOCAL = LocalPlacement()


class ChunkRouter:
    def __init__(self, cache: ChunkCache, pins: Pins, placement: Placement = LOCAL) -> None:
        self.cache = cache
        self.pins = pins
        self.placement = placement
        self.chunk_size = cache.chunk_size
        self.stats = cache.stats
        self._remote_reads: OrderedDict[ChunkId, int] = OrderedDict()  # bytes via peers
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the nursery of background fetches (readahead, near-cache copies)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # -- reading --------------------------------------------------------------------------

    async def read(self, key: str, etag: str, obj_size: int, offset: int, length: int
                   ) -> bytes:
        """Bytes [offset, offset+length) of an object version, wherever its chunks are."""
        end = min(offset + length, obj_size)
        parts: list[bytes] = []
        cs = self.chunk_size
        while offset < end:
            idx = offset // cs
            n = min(end, (idx + 1) * cs) - offset
            start = offset - idx * cs
            if self.cache.cached(key, etag, idx) is not None:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                owner = self.placement.owner(key, etag, idx)
                if owner is not None:
                    data = await self._read_remote(owner, key, etag, obj_size, idx, start, n)
                    if data is not None:
                        parts.append(data)
                        offset += n
                        continue
            parts.append(await self.cache.read_local(key, etag, obj_size, idx, start, n,
                                                     self.placement))
            offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_remote(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                           start: int, length: int) -> bytes | None:
        data = await self.placement.read(owner, key, etag, obj_size, idx, start, length)
        if data is None:
            self.stats.peer_fallbacks += 1
            return None
        self.stats.bytes_from_peers += len(data)
        # A remote chunk read more than once over (a second epoch, a re-read the page
        # cache lost) is hot: keep a copy in the near-cache.
        cid = (key, etag, idx)
        seen = self._remote_reads.pop(cid, 0) + len(data)
        if (self.cache.near_capacity and seen > self.cache.chunk_len(obj_size, idx)
                and self._nursery is not None and not self.cache.busy(key, etag, idx)):
            self._nursery.start_soon(self._near_one, owner, cid, obj_size)
        else:
            self._remote_reads[cid] = seen
            if len(self._remote_reads) > REMOTE_READS_KEPT:
                self._remote_reads.popitem(last=False)
        return data

    async def _near_one(self, owner: str, cid: ChunkId, obj_size: int) -> None:
        key, etag, idx = cid

        async def fetch() -> bytes | None:
            return await self.placement.fetch(owner, key, etag, obj_size, idx)

        try:
            await self.cache.ensure_near(key, etag, obj_size, idx, fetch)
        except Exception as e:  # best effort, like readahead
            log.debug("near-cache copy of %r chunk %d failed: %s", key, idx, e)

    # -- serving peers (we are the owner) -------------------------------------------------

    async def serve(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                    length: int) -> bytes:
        """Bytes of one chunk for a peer, from this node's cache (fetched from S3 or a
        previous owner if missing: never forwarded to another owner, so no loops)."""
        length = max(0, min(length, self.cache.chunk_len(obj_size, idx) - start))
        data = await self.cache.read_local(key, etag, obj_size, idx, start, length,
                                           self.placement)
        self.stats.bytes_served_to_peers += len(data)
        return data

    def cached_chunk(self, key: str, etag: str, idx: int) -> bytes | None:
        """The whole chunk if this node has it, without fetching."""
        ch = self.cache.cached(key, etag, idx)
        if ch is None:
            return None
        data = ch.read(0, ch.size)
        self.stats.bytes_served_to_peers += len(data)
        return data

    # -- readahead ------------------------------------------------------------------------

    def readahead(self, key: str, etag: str, obj_size: int, first: int, count: int) -> None:
        """Start background downloads of chunks first..first+count-1. In a cluster each
        owner is asked to fetch its own chunks, all owners at once."""
        last = (obj_size - 1) // self.chunk_size
        remote: dict[str, list[int]] = defaultdict(list)
        local: list[int] = []
        for idx in range(first, min(first + count, last + 1)):
            if self.cache.busy(key, etag, idx):
                continue
            owner = self.placement.owner(key, etag, idx)
            if owner is None:
                local.append(idx)
            else:
                remote[owner].append(idx)
        self.readahead_local(key, etag, obj_size, local)
        for owner, idxs in remote.items():
            self.placement.readahead(owner, key, etag, obj_size, idxs)

    def readahead_local(self, key: str, etag: str, obj_size: int, idxs: list[int]) -> None:
        """Start background downloads of these chunks into this node's cache."""
        if self._nursery is None:
            return
        for idx in idxs:
            if not self.cache.busy(key, etag, idx):
                self._nursery.start_soon(self._readahead_one, key, etag, obj_size, idx)

    async def _readahead_one(self, key: str, etag: str, obj_size: int, idx: int) -> None:
        try:
            await self.cache.ensure(key, etag, obj_size, idx, self.placement)
        except Exception as e:  # readahead is best effort; the real read reports errors
            log.debug("readahead of %r chunk %d failed: %s", key, idx, e)

    # -- small objects --------------------------------------------------------------------

    def fetches_whole(self, key: str, listed_size: int, listed_etag: str) -> bool:
        """Whether `head_by_get` should GET this object whole here: it is small, not
        cached yet, and its chunk 0 is this node's to hold."""
        return (0 < listed_size <= min(self.chunk_size, SMALL_OBJECT)
                and self.cache.cached(key, listed_etag, 0) is None
                and self.placement.owner(key, listed_etag, 0) is None)

    async def head_by_get(self, store: ObjectStore, key: str, listed_size: int
                          ) -> ObjectInfo | None:
        return await self.cache.head_by_get(store, key, listed_size)

    # -- object-level changes -------------------------------------------------------------

    def drop_object(self, key: str, keep_etag: str | None = None) -> None:
        """Forget this node's chunks of `key` (all versions but `keep_etag`); other nodes'
        copies of a version nobody reads age out of their LRU."""
        self.cache.drop_object(key, keep_etag)

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str) -> None:
        """A server-side copy: the same bytes under a new name and version."""
        self.cache.rekey(old_key, old_etag, new_key, new_etag)

    # -- prefetch -------------------------------------------------------------------------

    async def ensure_many(self, items: list[ChunkRef], pin: bool) -> list[str]:
        """Pins.ensure_local across the cluster: each owner fetches (and pins) its own
        chunks, all owners in parallel; chunks of an owner that cannot answer are fetched
        here."""
        by_owner: dict[str | None, list[int]] = defaultdict(list)
        for i, (key, etag, _, idx) in enumerate(items):
            by_owner[self.placement.owner(key, etag, idx)].append(i)
        out = [""] * len(items)

        async def run(owner: str | None, idxs: list[int]) -> None:
            part = [items[i] for i in idxs]
            res = None
            if owner is not None:
                res = await self.placement.ensure_remote(owner, part, pin)
            if res is None:
                res = await self.pins.ensure_local(part, pin)
            for i, r in zip(idxs, res, strict=True):
                out[i] = r

        async with trio.open_nursery() as nursery:
            for owner, idxs in by_owner.items():
                nursery.start_soon(run, owner, idxs)
        return out
