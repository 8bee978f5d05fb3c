"""Cluster membership: who is in the cluster, who is alive, and the ring over them.

Each node knows every member directly (GPU clusters are tens to hundreds of nodes, so an
all-to-all heartbeat every second is cheap) and decides liveness from its own contacts:
a member that has not answered for `timeout` seconds is taken off the ring; one that
answers again is put back. Requests that fail mark the member suspect at once, so reads
skip it (to the next node on the ring, which is who will own its chunks once it is gone)
without waiting for the timeout. Gossip in the heartbeats spreads news of members, but
only a direct answer makes a member alive, so a dead node is never revived by hearsay.

Members are identified by node id and incarnation (the start time of the daemon): a
restarted node replaces its old self, and a node that left is not re-added by stale gossip.

Views can differ for a heartbeat or two. That is safe here: chunks are immutable (named
by ETag), any node can serve any chunk, and placement only decides who caches what. The
Raft-replicated membership of the transaction layer will replace this view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from objcache.cluster.peers import PeerPool
from objcache.cluster.ring import Ring
from objcache.errors import AuthError, Conflict, PeerError, UserError

log = logging.getLogger(__name__)

ALIVE, JOINING, DEAD, LEFT = "alive", "joining", "dead", "left"
HISTORY_SECONDS = 600.0  # how long a previous owner is asked for chunks after a change
HISTORY_RINGS = 4
FORGET_DEAD_SECONDS = 600.0
SEED_RETRY_SECONDS = 5.0


@dataclass
class Member:
    id: str
    addr: str
    capacity: int
    incarnation: int
    used: int = 0
    raft: str = ""  # the node's Raft address
    raft_n: int = 0  # how many members its Raft group has, as it sees it
    state: str = ALIVE
    last_ok: float = 0.0  # time.monotonic() of the last direct answer
    state_since: float = field(default_factory=time.time)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "addr": self.addr, "cap": self.capacity,
                "inc": self.incarnation, "used": self.used, "raft": self.raft,
                "raft_n": self.raft_n}


def parse_record(rec: Any) -> Member:
    if not (isinstance(rec, dict) and isinstance(rec.get("id"), str)
            and isinstance(rec.get("addr"), str) and isinstance(rec.get("cap"), int)
            and isinstance(rec.get("inc"), int) and isinstance(rec.get("used", 0), int)
            and isinstance(rec.get("raft", ""), str) and isinstance(rec.get("raft_n", 0), int)):
        raise PeerError(f"malformed member record {rec!r:.200}")
    return Member(rec["id"], rec["addr"], rec["cap"], rec["inc"], rec.get("used", 0),
                  rec.get("raft", ""), rec.get("raft_n", 0))


def _nobody(node: str) -> None:
    pass


class Membership:
    """Attributes:
    on_suspect: called with a node id when it stops answering (cancel what waits on it).
    """

    def __init__(self, me: Member, seeds: list[str], pool: PeerPool, timeout: float,
                 used: Callable[[], int],
                 on_suspect: Callable[[str], None] = _nobody) -> None:
        self.me = me
        self.seeds = [s for s in seeds if s != me.addr]
        self.pool = pool
        self.timeout = timeout
        self.interval = min(1.0, timeout / 4)
        self._used = used
        self.members: dict[str, Member] = {}
        self.suspects: set[str] = set()
        self.ring = Ring({me.id: me.capacity})
        self.history: list[tuple[float, Ring]] = []
        self.changes = 0
        self.joined_at = 0.0  # when we joined an existing cluster (0: we formed ours)
        self._without_me: tuple[Ring, Ring] | None = None
        self.on_suspect = on_suspect

    # -- placement ------------------------------------------------------------------------

    def owner(self, point: str) -> str:
        """The node id that owns `point` now, skipping members that just failed."""
        return self.ring.owner(point, self.suspects) or self.me.id

    def previous_owners(self, point: str) -> list[Member]:
        """Live members that held `point` before recent ring changes, most likely first.

        When this node joined, the chunks it now owns were owned by whoever owns them on
        the ring without it: that ring comes first (it is not in `history`, which starts
        from our own lonely ring). Then the rings before later changes, newest first.
        """
        out: list[Member] = []
        current = self.owner(point)
        rings = [r for _, r in reversed(self.history)]
        if self.joined_at and time.monotonic() - self.joined_at < HISTORY_SECONDS:
            if self._without_me is None or self._without_me[0] is not self.ring:
                others = {n: c for n, c in self.ring.members.items() if n != self.me.id}
                self._without_me = (self.ring, Ring(others))
            rings.insert(0, self._without_me[1])
        for ring in rings:
            node = ring.owner(point)
            m = self.members.get(node or "")
            if (m is not None and node != current and m.state == ALIVE
                    and node not in self.suspects and m not in out):
                out.append(m)
        return out

    def addr_of(self, node: str) -> str | None:
        m = self.members.get(node)
        return m.addr if m is not None else None

    def joining(self, node: str) -> bool:
        """Heard of (gossip, `hear_of`), not reached yet."""
        m = self.members.get(node)
        return m is not None and m.state == JOINING

    def suspect(self, node: str) -> None:
        """Route around `node` until it answers a heartbeat again, and give up on the
        requests still waiting for it."""
        if node != self.me.id and node not in self.suspects:
            log.info("peer %s is not answering: routing around it until it does", node)
            self.suspects.add(node)
            self.on_suspect(node)

    def _rebuild(self) -> None:
        alive = {m.id: m.capacity for m in self.members.values() if m.state == ALIVE}
        alive[self.me.id] = self.me.capacity
        if alive == self.ring.members:
            return
        now = time.monotonic()
        self.history.append((now, self.ring))
        self.history = [(t, r) for t, r in self.history[-HISTORY_RINGS:]
                        if now - t < HISTORY_SECONDS]
        self.ring = Ring(alive)
        self.changes += 1
        log.info("ring changed: %d members (%s)", len(alive), ", ".join(sorted(alive)))

    # -- learning about members ----------------------------------------------------------

    def _heard_from(self, rec: Any) -> Member:
        """A member answered us or called us directly: it is alive."""
        new = parse_record(rec)
        if new.id == self.me.id:
            raise PeerError(f"a peer at {new.addr} claims our node id {new.id!r}")
        m = self.members.get(new.id)
        if m is None or new.incarnation > m.incarnation:
            if m is not None and m.state == ALIVE and m.addr != new.addr:
                log.warning("node %s moved from %s to %s", new.id, m.addr, new.addr)
            if m is None or m.state != ALIVE:
                log.info("peer %s (%s) is alive", new.id, new.addr)
            m = new
            self.members[m.id] = m
        elif new.incarnation < m.incarnation:
            raise PeerError(f"node {new.id} at {new.addr} is an old incarnation")
        else:
            m.addr, m.capacity, m.used = new.addr, new.capacity, new.used
            m.raft, m.raft_n = new.raft, new.raft_n
            if m.state == LEFT:
                raise PeerError(f"node {new.id} left the cluster")
            if m.state != ALIVE:
                log.info("peer %s (%s) is answering again", m.id, m.addr)
        if m.state != ALIVE:
            m.state, m.state_since = ALIVE, time.time()
        m.last_ok = time.monotonic()
        self.suspects.discard(m.id)
        self._rebuild()
        return m

    def _learn(self, records: Any) -> None:
        """Gossip: members someone else knows. They join the ring once they answer us."""
        if not isinstance(records, list):
            raise PeerError("malformed member list")
        for rec in records:
            new = parse_record(rec)
            if new.id == self.me.id:
                continue
            m = self.members.get(new.id)
            if m is None or new.incarnation > m.incarnation:
                new.state, new.last_ok = JOINING, time.monotonic()
                self.members[new.id] = new

    def hear_of(self, node: str, addr: str, capacity: int) -> bool:
        """A member known from elsewhere (the Raft log's member records) that we have not
        heard of: reachable by its address at once, pinged from now on, and on the ring
        once it answers. A restarted node with no seed up hears of the others only when
        they retry their seeds, SEED_RETRY_SECONDS later. False if we know it already."""
        if node == self.me.id or node in self.members:
            return False
        self.members[node] = Member(node, addr, capacity, 0, state=JOINING,
                                    last_ok=time.monotonic())
        return True

    def _failed(self, m: Member) -> None:
        silent = time.monotonic() - m.last_ok
        if silent > self.timeout / 2:
            self.suspect(m.id)
        if m.state == ALIVE and silent > self.timeout:
            log.warning("peer %s (%s) has not answered for %.1fs: taken off the ring",
                        m.id, m.addr, silent)
            m.state, m.state_since = DEAD, time.time()
            self._rebuild()
        elif m.state == JOINING and silent > self.timeout:
            del self.members[m.id]  # heard of, never reached
        elif m.state == DEAD and time.time() - m.state_since > FORGET_DEAD_SECONDS:
            del self.members[m.id]

    def _view(self) -> list[dict[str, Any]]:
        return [m.record() for m in self.members.values() if m.state == ALIVE]

    def _my_record(self) -> dict[str, Any]:
        self.me.used = self._used()
        return self.me.record()

    # -- requests from peers --------------------------------------------------------------

    def handle(self, peer: str, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        rec = msg.get("from")
        if not isinstance(rec, dict) or rec.get("id") != peer:
            raise PeerError(f"{op} from {peer} carries another node's record")
        if op in ("join", "ping"):
            old = self.members.get(peer)
            if (op == "join" and old is not None and old.state == ALIVE
                    and old.addr != rec.get("addr")
                    and time.monotonic() - old.last_ok < self.timeout):
                return {"error": Conflict.code,
                        "msg": f"node id {peer!r} is already used by the member at {old.addr}"}
            self._heard_from(rec)
            self._learn(msg.get("members", []))
            return {"from": self._my_record(), "members": self._view()}
        if op == "leave":
            m = self.members.get(peer)
            if m is not None and m.incarnation == rec.get("inc"):
                log.info("peer %s (%s) left the cluster", m.id, m.addr)
                m.state, m.state_since = LEFT, time.time()
                self._rebuild()
            return {}
        raise PeerError(f"unknown membership op {op!r}")

    # -- our side -------------------------------------------------------------------------

    async def _join_one(self, addr: str) -> None:
        reply, _ = await self.pool.request(addr, {"op": "join", "from": self._my_record(),
                                                  "members": self._view()},
                                           timeout=max(5.0, self.timeout))
        alone = len(self.ring) == 1
        self._heard_from(reply.get("from"))
        self._learn(reply.get("members"))
        if alone:
            # We joined an existing cluster: what we now own, others cached until now.
            self.joined_at = time.monotonic()

    async def _expand_seeds(self) -> list[str]:
        """Seeds as addresses: a name (a Kubernetes headless Service) can stand for every
        member; our own address is left out."""
        out: list[str] = []
        for seed in self.seeds:
            host, _, port = seed.rpartition(":")
            try:
                infos = await trio.socket.getaddrinfo(host.strip("[]"), int(port),
                                                      type=trio.socket.SOCK_STREAM)
            except OSError:
                out.append(seed)  # unresolvable now: keep it, the error names it
                continue
            for *_, sockaddr in infos:
                ip = sockaddr[0]
                addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if addr != self.me.addr and addr not in out:
                    out.append(addr)
        return out

    async def join(self) -> None:
        """Join through the seed peers; with none reachable, form a new cluster."""
        errors: list[str] = []
        for addr in await self._expand_seeds():
            try:
                await self._join_one(addr)
            except AuthError as e:
                raise UserError(f"cluster secret rejected by peer {addr}: every node needs "
                                "the same --cluster-secret-file") from e
            except PeerError as e:
                if isinstance(e, Conflict):
                    raise UserError(f"cannot join through {addr}: {e}") from e
                errors.append(str(e))
                continue
            log.info("joined the cluster through %s: %d members", addr, len(self.ring))
            return
        if self.seeds:
            log.warning("no peer reachable (%s); forming a new cluster",
                        "; ".join(errors))
        else:
            log.info("no peers given; forming a new cluster")

    async def run(self) -> None:
        """Heartbeats: ping every member each interval (a slow member delays only its own
        pings), and re-try seeds we are not joined to."""
        last_seed_try = time.monotonic()
        rounds = 0
        busy: set[str] = set()
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(self.interval)
                rounds += 1
                for m in list(self.members.values()):
                    if m.addr in busy:
                        continue
                    if m.state in (ALIVE, JOINING) or (m.state == DEAD and rounds % 5 == 0):
                        busy.add(m.addr)
                        nursery.start_soon(self._ping, m, busy)
                now = time.monotonic()
                if now - last_seed_try > SEED_RETRY_SECONDS:
                    last_seed_try = now
                    nursery.start_soon(self._retry_seeds, busy)

    async def _ping(self, m: Member, busy: set[str]) -> None:
        try:
            reply, _ = await self.pool.request(
                m.addr, {"op": "ping", "from": self._my_record(), "members": self._view()},
                timeout=max(self.interval, self.timeout / 2))
            if reply.get("from", {}).get("id") != m.id:
                raise PeerError(f"{m.addr} is now node {reply.get('from')!r:.100}")
            self._heard_from(reply["from"])
            self._learn(reply.get("members", []))
        except PeerError as e:
            log.debug("ping %s: %s", m.id, e)
            if self.members.get(m.id) is m:
                self._failed(m)
        finally:
            busy.discard(m.addr)

    async def _retry_seeds(self, busy: set[str]) -> None:
        """Seeds that are not (yet) members: clusters started at once merge this way."""
        known = {m.addr for m in self.members.values() if m.state == ALIVE}
        async with trio.open_nursery() as nursery:
            for addr in await self._expand_seeds():
                if addr not in known and addr not in busy:
                    busy.add(addr)
                    nursery.start_soon(self._try_seed, addr, busy)

    async def _try_seed(self, addr: str, busy: set[str]) -> None:
        try:
            await self._join_one(addr)
            log.info("reached seed peer %s: %d members", addr, len(self.ring))
        except PeerError as e:
            log.debug("seed %s: %s", addr, e)
        finally:
            busy.discard(addr)

    async def leave(self) -> None:
        """Tell every member we are going, so they re-route at once."""
        with trio.move_on_after(2):
            async with trio.open_nursery() as nursery:
                for m in list(self.members.values()):
                    if m.state == ALIVE:
                        nursery.start_soon(self._say_leave, m.addr)

    async def _say_leave(self, addr: str) -> None:
        try:
            await self.pool.request(addr, {"op": "leave", "from": self.me.record()},
                                    timeout=1.0)
        except PeerError:
            pass

    def shown_state(self, m: Member) -> str:
        """A member's state as status and metrics show it: alive ones that just failed a
        request or a heartbeat are "suspect"."""
        return "suspect" if m.state == ALIVE and m.id in self.suspects else m.state

    def status(self) -> list[dict[str, Any]]:
        shares = self.ring.shares()
        now = time.monotonic()
        rows = [{"id": self.me.id, "addr": self.me.addr, "state": "self",
                 "ring_share": round(shares.get(self.me.id, 0.0), 4),
                 "cache_used_bytes": self._used(), "cache_capacity_bytes": self.me.capacity,
                 "last_seen_seconds": 0.0}]
        for m in sorted(self.members.values(), key=lambda m: m.id):
            rows.append({"id": m.id, "addr": m.addr,
                         "state": self.shown_state(m),
                         "ring_share": round(shares.get(m.id, 0.0), 4),
                         "cache_used_bytes": m.used, "cache_capacity_bytes": m.capacity,
                         "last_seen_seconds": round(now - m.last_ok, 1) if m.last_ok else None})
        return rows
