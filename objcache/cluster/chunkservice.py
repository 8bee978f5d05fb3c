"""Serving chunks to peers: the requests a member answers as the owner of chunks.

`read` (a range of a chunk the caller says we own), `chunk` (a whole chunk; `cached_only`
never fetches): both send the xxh3 sums of the bytes' 256 KiB blocks, which the receiver
checks (objcache.cluster.placement), so bytes damaged on the way or by a faulty peer are
fetched from S3 instead, never served; `warm` (readahead), `prefetch` (fetch and maybe
pin many), `unpin` and `evict` (by path). Every field is type- and range-checked; a
request that does not parse is a protocol error and drops the connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from objcache.cache.chunks import block_sums
from objcache.cluster.peers import field_int, field_str
from objcache.errors import ProtocolError

if TYPE_CHECKING:
    from objcache.cache.pins import Pins
    from objcache.cache.router import ChunkRouter
    from objcache.cluster.peers import Handler, Reply

MAX_OBJECT_SIZE = 5 << 40  # S3's limit; anything larger in a request is garbage
MAX_PREFETCH_ITEMS = 4096
MAX_WARM_ITEMS = 1024


class ChunkService:
    def __init__(self, router: ChunkRouter, pins: Pins) -> None:
        self.router = router
        self.pins = pins
        self.chunk_size = router.chunk_size

    def routes(self) -> dict[str, Handler]:
        return {"read": self._read, "chunk": self._chunk, "warm": self._warm,
                "prefetch": self._prefetch, "unpin": self._unpin, "evict": self._evict,
                "verify": self._verify}

    def _chunk_args(self, msg: dict[str, Any]) -> tuple[str, str, int, int]:
        key, etag = field_str(msg, "key"), field_str(msg, "etag")
        size = field_int(msg, "size", 0, MAX_OBJECT_SIZE)
        idx = field_int(msg, "idx", 0, max(0, (size - 1) // self.chunk_size))
        return key, etag, size, idx

    async def _read(self, peer: str, msg: dict[str, Any]) -> Reply:
        key, etag, size, idx = self._chunk_args(msg)
        start = field_int(msg, "start", 0, self.chunk_size)
        length = field_int(msg, "len", 0, self.chunk_size)
        data = await self.router.serve(key, etag, size, idx, start, length)
        return {"data": len(data), "sums": self._sums(key, etag, idx, start, data)}, data

    async def _chunk(self, peer: str, msg: dict[str, Any]) -> Reply:
        key, etag, size, idx = self._chunk_args(msg)
        if msg.get("cached_only"):
            data = self.router.cached_chunk(key, etag, idx)
            if data is None:
                return {"cached": False}, None
        else:
            data = await self.router.serve(key, etag, size, idx, 0, self.chunk_size)
        return {"data": len(data), "sums": self._sums(key, etag, idx, 0, data)}, data

    def _sums(self, key: str, etag: str, idx: int, start: int, data: bytes | memoryview
              ) -> bytes:
        """The block sums of bytes we send: those of the cache file when we have the chunk
        (computed when it was downloaded, so bytes that went wrong here since do not
        pass), else of the bytes themselves (a download in flight)."""
        sums = self.router.cache.block_sums_of(key, etag, idx, start, len(data))
        return sums if sums is not None else block_sums(data)

    async def _warm(self, peer: str, msg: dict[str, Any]) -> Reply:
        key, etag, size, _ = self._chunk_args(msg)
        idxs = msg.get("idxs")
        last = max(0, (size - 1) // self.chunk_size)
        if (not isinstance(idxs, list) or len(idxs) > MAX_WARM_ITEMS
                or not all(isinstance(i, int) and 0 <= i <= last for i in idxs)):
            raise ProtocolError("request field 'idxs' is not a list of chunk indexes")
        self.router.readahead_local(key, etag, size, idxs)
        return {}, None

    async def _prefetch(self, peer: str, msg: dict[str, Any]) -> Reply:
        items = msg.get("items")
        if not isinstance(items, list) or len(items) > MAX_PREFETCH_ITEMS:
            raise ProtocolError("request field 'items' is not a list of chunks")
        refs = []
        for it in items:
            if not (isinstance(it, list) and len(it) == 4):
                raise ProtocolError("a prefetch item is not [key, etag, size, idx]")
            refs.append(self._chunk_args(dict(zip(("key", "etag", "size", "idx"), it,
                                                  strict=True))))
        results = await self.pins.ensure_local(refs, bool(msg.get("pin")))
        return {"results": results}, None

    async def _unpin(self, peer: str, msg: dict[str, Any]) -> Reply:
        return {"bytes": self.pins.unpin(field_str(msg, "prefix"))}, None

    async def _evict(self, peer: str, msg: dict[str, Any]) -> Reply:
        dropped, kept = await self.pins.evict(field_str(msg, "prefix"))
        return {"bytes": dropped, "pinned_kept": kept}, None

    async def _verify(self, peer: str, msg: dict[str, Any]) -> Reply:
        checked, nbytes, corrupt = await self.router.cache.verify(field_str(msg, "prefix"))
        return {"chunks": checked, "bytes": nbytes, "corrupt": corrupt}, None
