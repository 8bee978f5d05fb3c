"""Object metadata shared by the cluster: each key's HEAD answer is kept by the key's
owner on the ring (besides whoever made it), so the cluster HEADs an object version once.

A node that HEADs a key it does not own sends the answer to the owner (`meta.put`, in
batches, in the background). A node listing a directory asks the owners for the versions
it does not know (`meta.get`, up to ITEMS keys per request) before it HEADs anything:
another node's `ls -l` of a directory this one listed costs LISTs only. An owner that
does not answer in time is a miss (a HEAD), never an error. Every field is type- and
range-checked; a request that does not parse is a protocol error.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from objcache.cache.objmeta import ObjectMeta, modified_s
from objcache.cluster.peers import field_int
from objcache.errors import ObjcacheError, ProtocolError
from objcache.store import ObjectInfo
from objcache.ticks import sleep_ticks

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Membership
    from objcache.cluster.peers import Handler, Reply

log = logging.getLogger(__name__)

ITEMS = 1000  # keys per request (a LIST page)
MAX_KEY = 1024
MAX_META_FIELDS = 64
MAX_FIELD = 2048
PUSH_SECONDS = 0.5  # how often buffered answers go to their owners


def meta_point(key: str) -> str:
    """Where a key's metadata lives on the ring (NUL never occurs in keys)."""
    return f"{key}\0meta"


def _version(item: Any) -> tuple[str, str, int]:
    if not (isinstance(item, list) and len(item) >= 3 and isinstance(item[0], str)
            and isinstance(item[1], str) and len(item[0]) <= MAX_KEY
            and len(item[1]) <= MAX_FIELD):
        raise ProtocolError("a metadata item is [key, etag, modified, ...]")
    return item[0], item[1], field_int({"m": item[2]}, "m", 0, 1 << 40)


def _meta(raw: Any) -> dict[str, str]:
    if (not isinstance(raw, dict) or len(raw) > MAX_META_FIELDS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_FIELD
                       and len(v) <= MAX_FIELD for k, v in raw.items())):
        raise ProtocolError("metadata is a small map of strings")
    return raw


def _items(msg: dict[str, Any]) -> list[Any]:
    items = msg.get("items")
    if not isinstance(items, list) or len(items) > ITEMS:
        raise ProtocolError(f"items must be a list of at most {ITEMS}")
    return items


class SharedObjectMeta:
    """This node's rows (objcache.cache.objmeta) and the owners'."""

    def __init__(self, local: ObjectMeta, membership: Membership, client: PeerClient,
                 timeout: float) -> None:
        self.local = local
        self.membership = membership
        self.client = client
        self.timeout = timeout
        self._outbox: dict[str, list[list[Any]]] = defaultdict(list)
        self.from_peers = 0  # versions a peer knew (a HEAD each, saved)

    def routes(self) -> dict[str, Handler]:
        return {"meta.get": self._get, "meta.put": self._put}

    def _owner(self, key: str) -> str | None:
        node = self.membership.owner(meta_point(key))
        return None if node == self.membership.me.id else node

    # -- the core's side --------------------------------------------------------------------

    async def lookup(self, objs: Sequence[ObjectInfo]) -> dict[str, dict[str, str]]:
        out = await self.local.lookup(objs)
        by_owner: dict[str, list[ObjectInfo]] = defaultdict(list)
        for o in objs:
            owner = self._owner(o.key) if o.key not in out else None
            if owner is not None:
                by_owner[owner].append(o)

        async def ask(owner: str, part: list[ObjectInfo]) -> None:
            msg = {"op": "meta.get",
                   "items": [[o.key, o.etag, modified_s(o)] for o in part]}
            try:
                got = await self.client.call(owner, msg, 0, self.timeout)
            except ObjcacheError as e:  # refused: a miss, HEADed as usual
                log.info("metadata of %d keys not answered by %s: %s", len(part), owner, e)
                return
            if got is None:
                return
            want = {o.key: o for o in part}
            try:
                answer = got[0].get("meta")
                if not isinstance(answer, dict):
                    raise ProtocolError("meta.get answers a map")
                for key, raw in answer.items():
                    o = want.get(key) if isinstance(key, str) else None
                    if o is None:
                        continue
                    meta = _meta(raw)
                    out[key] = meta
                    self.local.put(key, o.etag, modified_s(o), meta)
                    self.from_peers += 1
            except ProtocolError as e:
                log.warning("ignoring %s's metadata answer: %s", owner, e)

        async with trio.open_nursery() as n:
            for owner, mine in by_owner.items():
                for i in range(0, len(mine), ITEMS):
                    n.start_soon(ask, owner, mine[i:i + ITEMS])
        return out

    def remember(self, info: ObjectInfo) -> None:
        if info.metadata is None:
            return
        self.local.remember(info)
        owner = self._owner(info.key)
        if owner is not None:
            self._outbox[owner].append([info.key, info.etag, modified_s(info),
                                        info.metadata])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Send what was HEADed here to the keys' owners, every PUSH_SECONDS."""
        task_status.started()
        while True:
            await sleep_ticks(PUSH_SECONDS)
            outbox, self._outbox = self._outbox, defaultdict(list)
            async with trio.open_nursery() as n:
                for owner, items in outbox.items():
                    for i in range(0, len(items), ITEMS):
                        n.start_soon(self._put_to, owner, items[i:i + ITEMS])

    async def _put_to(self, owner: str, items: list[list[Any]]) -> None:
        """Best effort: an owner that does not take them HEADs those keys itself."""
        try:
            await self.client.call(owner, {"op": "meta.put", "items": items}, 0,
                                   self.timeout)
        except ObjcacheError as e:
            log.info("metadata for %d keys not taken by %s: %s", len(items), owner, e)

    # -- the owner's side -------------------------------------------------------------------

    async def _get(self, peer: str, msg: dict[str, Any]) -> Reply:
        versions = [_version(it) for it in _items(msg)]
        return {"meta": self.local.get_many(versions)}, None

    async def _put(self, peer: str, msg: dict[str, Any]) -> Reply:
        rows = []
        for it in _items(msg):
            key, etag, mod = _version(it)
            if len(it) != 4:
                raise ProtocolError("a metadata put is [key, etag, modified, meta]")
            rows.append((key, etag, mod, _meta(it[3])))
        for row in rows:
            self.local.put(*row)
        return {"ok": True}, None
