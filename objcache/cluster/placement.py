"""Chunk placement in a cluster: who owns a chunk, and asking owners for chunks.

Implements the chunk cache's `Placement` (objcache.cache.router) and `PreviousOwners`
(objcache.cache.chunks) over the membership ring and peer requests. A peer that cannot
answer makes these return None, and the cache falls back to S3.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
import xxhash

from objcache.cache.chunks import VERIFY_BLOCK
from objcache.cluster.ring import chunk_point
from objcache.errors import BadChecksum

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Membership

log = logging.getLogger(__name__)

MAX_PREFETCH_ITEMS = 4096
PREFETCH_TIMEOUT = 3600.0  # an owner fetching thousands of chunks; cancelled if it dies
WARM_AGAIN = 10.0  # seconds before the same chunk is worth warming at its owner again
WARMED_KEPT = 4096


class _Verifier:
    """Checks a peer's chunk bytes against the block sums it sent, as they arrive, and
    passes on how many are in and verified."""

    __slots__ = ("peer", "sums", "view", "progress", "checked")

    def __init__(self, peer: str, sums: object, view: memoryview,
                 progress: Callable[[int], None] | None = None) -> None:
        self.peer = peer
        nblocks = -(-len(view) // VERIFY_BLOCK)
        if not isinstance(sums, bytes) or len(sums) != 8 * nblocks:
            raise BadChecksum(f"peer {peer} sent chunk bytes without their block sums")
        self.sums = sums
        self.view = view
        self.progress = progress
        self.checked = 0  # bytes verified

    def arrived(self, n: int) -> None:
        end = n if n == len(self.view) else n // VERIFY_BLOCK * VERIFY_BLOCK
        while self.checked < end:
            b = self.checked // VERIFY_BLOCK
            stop = min(self.checked + VERIFY_BLOCK, len(self.view))
            if xxhash.xxh3_64_digest(self.view[self.checked:stop]) != \
                    self.sums[b * 8:b * 8 + 8]:
                raise BadChecksum(f"peer {self.peer} sent chunk bytes that fail their "
                                  f"checksums (block {b})")
            self.checked = stop
        if self.progress is not None and end:
            self.progress(end)


class ChunkPlacement:
    def __init__(self, membership: Membership, client: PeerClient, chunk_size: int,
                 request_timeout: float) -> None:
        self.membership = membership
        self.client = client
        self.node_id = membership.me.id
        self.chunk_size = chunk_size
        self.request_timeout = request_timeout
        self._warmed: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the nursery of fire-and-forget readahead requests."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        node = self.membership.owner(chunk_point(key, etag, idx))
        return None if node == self.node_id else node

    async def read_into(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                        start: int, view: memoryview, progress: Callable[[int], None]
                        ) -> bool:
        """Bytes of a chunk from its owner into `view`; readers are told of them block by
        block, each once it matches the sum the owner sent (a mismatch drops the
        connection and fails the read: the caller reads S3)."""

        def verifying(reply: dict[str, Any]) -> Callable[[int], None]:
            return _Verifier(owner, reply.get("sums"), view, progress).arrived

        got = await self.client.call(owner, {"op": "read", "key": key, "etag": etag,
                                             "size": obj_size, "idx": idx, "start": start,
                                             "len": len(view)},
                                     max_data=len(view), timeout=self.request_timeout,
                                     into=view, progress=verifying)
        return got is not None and got[1] is not None

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None:
        for m in self.membership.previous_owners(chunk_point(key, etag, idx)):
            got = await self.client.call(m.id, {"op": "chunk", "key": key, "etag": etag,
                                                "size": obj_size, "idx": idx,
                                                "cached_only": True},
                                         max_data=self.chunk_size,
                                         timeout=self.request_timeout)
            if got is not None and got[1] is not None:
                data = got[1]
                try:
                    _Verifier(m.id, got[0].get("sums"), memoryview(data)).arrived(len(data))
                except BadChecksum as e:
                    log.warning("%s", e)
                    continue
                log.debug("chunk %d of %r came from previous owner %s", idx, key, m.id)
                return bytes(data)
        return None

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        # A sequential reader asks on every read; tell each owner about a chunk once.
        now = time.monotonic()
        fresh = [i for i in idxs if now - self._warmed.get((key, etag, i), -WARM_AGAIN) >=
                 WARM_AGAIN]
        if not fresh or self._nursery is None:
            return
        for i in fresh:
            self._warmed[(key, etag, i)] = now
            self._warmed.move_to_end((key, etag, i))
        while len(self._warmed) > WARMED_KEPT:
            self._warmed.popitem(last=False)
        self._nursery.start_soon(self.client.call, owner,
                                 {"op": "warm", "key": key, "etag": etag, "size": obj_size,
                                  "idx": fresh[0], "idxs": fresh}, 0, 5.0)

    async def ensure_remote(self, owner: str, items: list[tuple[str, str, int, int]],
                            pin: bool) -> list[str] | None:
        results: list[str] = []
        for start in range(0, len(items), MAX_PREFETCH_ITEMS):
            part = items[start:start + MAX_PREFETCH_ITEMS]
            got = await self.client.call(owner, {"op": "prefetch",
                                                 "items": [list(i) for i in part],
                                                 "pin": pin},
                                         max_data=0, timeout=PREFETCH_TIMEOUT)
            res = None if got is None else got[0].get("results")
            if not (isinstance(res, list) and len(res) == len(part)
                    and all(isinstance(r, str) for r in res)):
                return None
            results += res
        return results
