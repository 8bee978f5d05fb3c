"""Requests to other members by node id: routed around members that stop answering.

A request to a member that fails to answer marks it suspect (reads then skip it), and
every request still waiting on a member is cancelled once the member is suspect (its
heartbeats stopped), so a hung peer costs a fallback, never a hang. A member that answered
with an error is alive: the error goes to the caller, the member stays in the ring.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import trio

from objcache.errors import PeerError

if TYPE_CHECKING:
    from objcache.cluster.membership import Membership
    from objcache.cluster.peers import PeerPool, Progress

log = logging.getLogger(__name__)


class Inflight:
    """Requests waiting on each member, so they can be cancelled when it goes quiet, and
    when each becomes overdue: waiting that long, its member is probed out of turn
    (`overdue`, read by objcache.cluster.membership)."""

    def __init__(self) -> None:
        # node -> {scope: (monotonic) when the request is overdue; inf: never}
        self._scopes: dict[str, dict[trio.CancelScope, float]] = defaultdict(dict)

    def cancel(self, node: str) -> None:
        for scope in self._scopes.pop(node, ()):
            scope.cancel()

    def add(self, node: str, scope: trio.CancelScope, overdue_at: float = math.inf) -> None:
        self._scopes[node][scope] = overdue_at

    def discard(self, node: str, scope: trio.CancelScope) -> None:
        self._scopes.get(node, {}).pop(scope, None)

    def overdue(self) -> list[str]:
        """Members a request has waited on past its time."""
        now = time.monotonic()
        return [node for node, scopes in self._scopes.items()
                if any(at <= now for at in scopes.values())]


class PeerClient:
    def __init__(self, membership: Membership, pool: PeerPool, inflight: Inflight) -> None:
        self.membership = membership
        self.pool = pool
        self.inflight = inflight
        self.node_id = membership.me.id

    async def call(self, node: str, msg: dict[str, Any], max_data: int, timeout: float,
                   into: memoryview | None = None, progress: Progress | None = None,
                   long_poll: bool = False
                   ) -> tuple[dict[str, Any], bytearray | memoryview | None] | None:
        """A request to a member; None (and the member routed around) if it cannot answer.
        An error the member answered with is raised when it is about the request, and
        treated as unanswered (without suspecting the member) otherwise.

        Waiting past half of --peer-timeout, the member is probed out of turn, so a
        member that went silent while it had the request is routed around within about
        --peer-timeout, not when its turn among the members comes (seed 5919: a holder cut
        off just after it was asked held a READ 6.7 s). `long_poll`: a request the member
        answers late on purpose (a learner's feed), which is not watched."""
        addr = self.membership.addr_of(node)
        if addr is None:
            return None
        scope = trio.CancelScope()
        self.inflight.add(node, scope, math.inf if long_poll else
                          time.monotonic() + self.membership.timeout / 2)
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
