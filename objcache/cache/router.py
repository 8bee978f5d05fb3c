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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from objcache.cache.chunks import SMALL_OBJECT, ChunkCache, ChunkId, PreviousOwners
from objcache.cache.pins import ChunkRef, Pins
from objcache.errors import PeerError

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

    async def read_into(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                        start: int, view: memoryview, progress: Callable[[int], None]
                        ) -> bool:
        """Bytes [start, start+len(view)) of a chunk from its owner into `view`."""
        ...

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        """Ask `owner` to start fetching these chunks (readahead), without waiting."""
        ...

    async def ensure_remote(self, owner: str, items: list[ChunkRef], pin: bool
                            ) -> list[str] | None:
        """Have `owner` run Pins.ensure_local on these chunks and wait for its outcomes."""
        ...


class OwnerSource:
    """Another node's chunk, read from its owner piece by piece into our buffer."""

    from_peer = True

    def __init__(self, placement: Placement, owner: str) -> None:
        self.placement = placement
        self.owner = owner

    async def fill(self, cid: ChunkId, obj_size: int, start: int, view: memoryview,
                   progress: Callable[[int], None]) -> None:
        key, etag, idx = cid
        if not await self.placement.read_into(self.owner, key, etag, obj_size, idx, start,
                                              view, progress):
            raise PeerError(f"owner {self.owner} did not send chunk {idx} of {key!r}")


class LocalPlacement:
    """A single node: every chunk is ours."""

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        return None

    async def read_into(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                        start: int, view: memoryview, progress: Callable[[int], None]
                        ) -> bool:
        return False

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
        self._sources: dict[str, OwnerSource] = {}

    # -- reading --------------------------------------------------------------------------

    async def read(self, key: str, etag: str, obj_size: int, offset: int, length: int,
                   volatile: bool = False) -> bytes | bytearray | memoryview:
        """Bytes [offset, offset+length) of an object version, wherever its chunks are.
        `volatile`: the caller uses them before it next awaits (a FUSE reply), so a view
        of a buffer may come back instead of a copy."""
        end = min(offset + length, obj_size)
        parts: list[bytes | bytearray | memoryview] = []
        cs = self.chunk_size
        while offset < end:
            idx = offset // cs
            n = min(end, (idx + 1) * cs) - offset
            whole = not parts and offset + n == end  # one chunk holds all of it
            data = await self._chunk(key, etag, obj_size, idx, offset - idx * cs, n,
                                     volatile and whole)
            parts.append(data)
            offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _chunk(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                     n: int, volatile: bool) -> bytes | memoryview:
        cache = self.cache
        if cache.busy(key, etag, idx):
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        owner = self.placement.owner(key, etag, idx)
        if owner is not None:
            try:
                return await cache.read(key, etag, obj_size, idx, start, n,
                                        self._from(owner), **self._remote_policy(
                                            key, etag, obj_size, idx, n),
                                        volatile=volatile)
            except PeerError as e:
                self.stats.peer_fallbacks += 1
                log.info("owner %s could not serve chunk %d of %r, reading S3: %s", owner,
                         idx, key, e)
        return await cache.read(key, etag, obj_size, idx, start, n,
                                previous=self.placement, volatile=volatile)

    def _from(self, owner: str) -> OwnerSource:
        src = self._sources.get(owner)
        if src is None:
            src = self._sources[owner] = OwnerSource(self.placement, owner)
        return src

    def _remote_policy(self, key: str, etag: str, obj_size: int, idx: int, n: int
                       ) -> dict[str, bool]:
        """Another node's chunk goes through memory, and is kept here (the near-cache)
        once it has been read more than once over (a second epoch, a re-read the page
        cache lost)."""
        cid = (key, etag, idx)
        seen = self._remote_reads.pop(cid, 0) + n
        self._remote_reads[cid] = seen
        if len(self._remote_reads) > REMOTE_READS_KEPT:
            self._remote_reads.popitem(last=False)
        # An object that fits the near-cache twice over is kept whole from its first
        # read: with every chunk here, its next open is served by the kernel
        # (passthrough) instead of crossing the network and the daemon again.
        hot = bool(self.cache.near_capacity) and (
            obj_size <= self.cache.near_capacity // 2
            or seen > self.cache.chunk_len(obj_size, idx))
        if hot and seen - n <= self.cache.chunk_len(obj_size, idx) < seen:
            log.debug("chunk %d of %r read more than once over here (%d bytes): kept in the "
                      "near-cache", idx, key, seen)
        return {"keep": hot, "near": hot}

    def landing(self, key: str, etag: str, size: int) -> bool:
        """Whether this object misses only chunks being written here (see ChunkCache)."""
        return self.cache.landing(key, etag, size)

    async def landed(self, key: str, etag: str, size: int, patience: float) -> None:
        """Until this object's chunks being written here are on disk (see ChunkCache)."""
        await self.cache.landed(key, etag, size, patience)

    def whole_file(self, key: str, etag: str, size: int) -> str | None:
        """The file holding every byte of this object version on this node, if one does
        (chunks this node owns and near-cache copies of others' share it)."""
        return self.cache.whole_file(key, etag, size)

    # -- serving peers (we are the owner) -------------------------------------------------

    async def serve(self, key: str, etag: str, obj_size: int, idx: int, start: int,
                    length: int) -> bytes | memoryview:
        """Bytes of one chunk for a peer, from this node's cache (fetched from S3 or a
        previous owner if missing: never forwarded to another owner, so no loops)."""
        length = max(0, min(length, self.cache.chunk_len(obj_size, idx) - start))
        data = await self.cache.read_local(key, etag, obj_size, idx, start, length,
                                           self.placement)
        self.stats.bytes_served_to_peers += len(data)
        return data

    def cached_chunk(self, key: str, etag: str, idx: int) -> memoryview | None:
        """The whole chunk if this node has it (verified), without fetching."""
        data = self.cache.read_cached(key, etag, idx)
        if data is not None:
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
                self.cache.advise(key, etag, idx)  # cached: its pages come ahead
                continue
            owner = self.placement.owner(key, etag, idx)
            if owner is None:
                local.append(idx)
            else:
                remote[owner].append(idx)
        self.readahead_local(key, etag, obj_size, local)
        for owner, idxs in remote.items():
            # Another node's chunks come ahead into memory here (the owner fetches them
            # from S3 first if it must); those without a free buffer are only announced,
            # so that the owner has them when we ask.
            src = self._from(owner)
            started = 0
            for idx in idxs:
                if not self.cache.start(key, etag, obj_size, idx, source=src, keep=False):
                    break
                started += 1
            if idxs[started:]:
                self.placement.readahead(owner, key, etag, obj_size, idxs[started:])

    def readahead_local(self, key: str, etag: str, obj_size: int, idxs: list[int]) -> None:
        """Start background downloads of these chunks into this node's cache, as far as
        download buffers are free now (readahead never queues behind readers)."""
        for idx in idxs:
            if self.cache.cached(key, etag, idx) is not None:
                self.cache.advise(key, etag, idx)
            elif not self.cache.busy(key, etag, idx) and not self.cache.start(
                    key, etag, obj_size, idx, previous=self.placement):
                return

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

    async def head_by_get_many(self, store: ObjectStore, items: Sequence[tuple[str, int]],
                               each: Callable[[str, ObjectInfo | None | Exception], None]
                               ) -> None:
        await self.cache.head_by_get_many(store, items, each)

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
