"""Requests to other members by node id: routed around members that stop answering.

A request to a member that fails to answer marks it suspect (reads then skip it), and
every request still waiting on a member is cancelled once the member is suspect (its
heartbeats stopped), so a hung peer costs a fallback, never a hang. A member that answered
with an error is alive: the error goes to the caller, the member stays in the ring.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import trio

from objcache.errors import PeerError

if TYPE_CHECKING:
    from objcache.cluster.membership import Membership
    from objcache.cluster.peers import PeerPool, Progress

log = logging.getLogger(__name__)


class Inflight:
    """Requests waiting on each member, so they can be cancelled when it goes quiet."""

    def __init__(self) -> None:
        self._scopes: dict[str, set[trio.CancelScope]] = defaultdict(set)

    def cancel(self, node: str) -> None:
        for scope in self._scopes.pop(node, ()):
            scope.cancel()

    def add(self, node: str, scope: trio.CancelScope) -> None:
        self._scopes[node].add(scope)

    def discard(self, node: str, scope: trio.CancelScope) -> None:
        self._scopes.get(node, set()).discard(scope)


class PeerClient:
    def __init__(self, membership: Membership, pool: PeerPool, inflight: Inflight) -> None:
        self.membership = membership
        self.pool = pool
        self.inflight = inflight
        self.node_id = membership.me.id

    async def call(self, node: str, msg: dict[str, Any], max_data: int, timeout: float,
                   into: memoryview | None = None, progress: Progress | None = None
                   ) -> tuple[dict[str, Any], bytearray | memoryview | None] | None:
        """A request to a member; None (and the member routed around) if it cannot answer.
        An error the member answered with is raised when it is about the request, and
        treated as unanswered (without suspecting the member) otherwise."""
        addr = self.membership.addr_of(node)
        if addr is None:
            return None
        scope = trio.CancelScope()
        self.inflight.add(node, scope)
        try:
            with scope:
                return await self.pool.request(addr, msg, timeout=timeout, max_data=max_data,
                                               into=into, progress=progress)
            log.info("request %r to %s abandoned: the peer stopped answering", msg["op"], node)
            return None
        except PeerError as e:
            if not e.answered:
                self.membership.suspect(node)
            log.info("peer %s could not serve %r, falling back: %s", node, msg["op"], e)
            return None
        finally:
            self.inflight.discard(node, scope)

    async def broadcast(self, msg: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
        """Send `msg` to every live member (not us); each one's reply, None if it failed."""
        out: dict[str, dict[str, Any] | None] = {}

        async def one(node: str) -> None:
            got = await self.call(node, msg, max_data=0, timeout=30.0)
            out[node] = None if got is None else got[0]

        async with trio.open_nursery() as nursery:
            for node in self.membership.ring.members:
                if node != self.node_id:
                    nursery.start_soon(one, node)
        return out
