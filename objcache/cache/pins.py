"""Prefetch and pinning on this node: making chunks cached (and kept) on request, and
letting them go again by path.

Pinned chunks leave the LRU list (their flag is in the chunk table, so pins survive
restarts); eviction never takes them, so a pin that needs room only pinned or dirty data
holds fails instead. Spreading a prefetch over the cluster's owners is
objcache.cache.router's job; this is what each owner does with its share.
"""

from __future__ import annotations

import trio

from objcache.cache.chunks import NO_PREVIOUS, ChunkCache, PreviousOwners
from objcache.errors import ObjcacheError

ChunkRef = tuple[str, str, int, int]  # (key, etag, object size, index): enough to fetch it
PARALLEL = 16
EVICT_LANDING_WAIT = 5.0  # seconds an eviction waits for chunks being written
CACHED, FETCHED = "cached", "fetched"


def failure(e: ObjcacheError) -> str:
    """A prefetch outcome for a chunk that could not be fetched: 'error:<code>:<text>'."""
    return f"error:{e.code}:{e}"


class Pins:
    def __init__(self, cache: ChunkCache, previous: PreviousOwners = NO_PREVIOUS) -> None:
        self.cache = cache
        self.previous = previous

    async def ensure_local(self, items: list[ChunkRef], pin: bool) -> list[str]:
        """Make these chunks cached here (pinned if asked); one outcome per item: CACHED
        (it already was), FETCHED, or a failure()."""
        out = [""] * len(items)
        limit = trio.Semaphore(PARALLEL)

        async def one(i: int, ref: ChunkRef) -> None:
            key, etag, size, idx = ref
            async with limit:
                was = self.cache.cached(key, etag, idx) is not None
                try:
                    ch = await self.cache.ensure(key, etag, size, idx, self.previous)
                except ObjcacheError as e:
                    out[i] = failure(e)
                    return
                if ch is None:
                    out[i] = ("error:nospace:the cache is full of pinned or dirty data"
                              if pin else "error:nospace:no room in the cache")
                    return
                if pin:
                    self.cache.set_pinned(ch, True)
                out[i] = CACHED if was else FETCHED

        async with trio.open_nursery() as nursery:
            for i, ref in enumerate(items):
                nursery.start_soon(one, i, ref)
        return out

    def unpin(self, prefix: str) -> int:
        """Make pinned chunks under `prefix` evictable again; returns their bytes."""
        total = 0
        for ch in list(self.cache.under(prefix)):
            if ch.pinned:
                self.cache.set_pinned(ch, False)
                total += ch.size
        return total

    async def evict(self, prefix: str) -> tuple[int, int]:
        """Drop unpinned chunks under `prefix`, those on their way to the disk too (a read
        just before: they landed after the eviction, and the next open was passed
        through to them); returns (bytes dropped, pinned bytes kept)."""
        await self.cache.landed_under(prefix, EVICT_LANDING_WAIT)
        dropped = kept = 0
        for ch in list(self.cache.under(prefix)):
            if ch.pinned:
                kept += ch.size
            else:
                self.cache.remove(ch)
                dropped += ch.size
        return dropped, kept
