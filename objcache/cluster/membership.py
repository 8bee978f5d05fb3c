"""Cluster membership: who is in the cluster, who is alive, and the ring over them.

Failure detection is SWIM-style (Das, Gupta, Motivala 2002, with Lifeguard's refutation),
so that its cost per node does not grow with the cluster: every protocol period
(`interval`, a quarter of --peer-timeout, at most 1 s) a node probes ONE member, taking
them in a shuffled round-robin order, with a `ping`. If no answer comes within half a
period, it asks up to `INDIRECT` other members to probe it (`ping_req`), which tells a dead
member from a lost path. A member neither answers is *suspect*: this node routes around it
at once (requests waiting on it are cancelled and fall back to S3), and says so in gossip.
A suspect that does not refute the suspicion within half of --peer-timeout is *dead*: taken
off the ring, and said so in gossip. Each node sends about two messages per period (its
probe and the answer to the one probe it receives on average), however many members there
are; an all-to-all heartbeat costs N-1 of each per node and N^2 in the cluster.

Gossip rides on those messages: every ping, answer and join carries up to
`PIGGYBACK` recent updates (a member alive, suspect, dead or gone, with its record), each
sent about 3 log2(N) times, so news reaches every node in O(log N) periods. Updates are
ordered by a member's version (incarnation = start time, then a sequence number only the
member itself raises): news of a member at an older version is ignored, so a dead node is
never revived by hearsay; a member that hears itself suspected or declared dead raises
its sequence and gossips that it is alive (it refutes). A direct answer always counts: a
member that answers this node is alive here. Every `SYNC_EVERY` periods a probe also asks
for the whole view (anti-entropy, for news a node missed, e.g. across a partition).

A node joins through a seed (`join`, answered with the seed's whole view, tried in random
order so joins spread over the seeds); with none reachable it forms a new cluster, and
keeps retrying its seeds every 5 s so clusters started at the same moment merge. A clean
shutdown sends `leave` to every member, so they re-route at once. Dead members are probed
again every few periods (one at a time) and come back when they answer; they are forgotten
after 10 minutes. A request that fails marks its member suspect here at once (routing
around it) and has it probed first in the next period.

Alive is not the same as reachable from here. A member that others reach (the indirect
probe answers) but that has not answered this node directly for half of --peer-timeout has
lost its path from here (a one-way or partial partition): requests from this node to it
would wait on a path that drops them (a close's replication waited 19 s that way in a
partition campaign, seed 1609). This node then routes around it, and gives up on what
waits on it, until it answers this node again; it stays on every ring and nothing is
gossiped, since the others reach it. A request it sends us does not count: the way back
may be the lost one.

Views can differ for a few periods. That is safe here: chunks are immutable (named by
ETag), any node can serve any chunk, and placement only decides who caches what; the
Raft group (objcache.cluster.raftgroup) decides who owns inodes and dirty data.
"""

from __future__ import annotations

import logging
import math
import random
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
# A node starting without a Raft log waits this long for one of its seeds to answer
# before it forms a cluster of its own, trying them again every JOIN_RETRY_SECONDS.
JOIN_PATIENCE = 5.0
JOIN_RETRY_SECONDS = 0.25
INDIRECT = 3  # members asked to probe a member that did not answer
PIGGYBACK = 8  # updates carried by one message
RETRANSMIT = 3  # an update is sent about RETRANSMIT * log2(N + 1) times
REVIVE_EVERY = 5  # periods between two probes of a dead member
SYNC_EVERY = 30  # periods between two requests for a member's whole view
RING_LOG_SECONDS = 10.0
KINDS = (ALIVE, "suspect", DEAD, LEFT)


@dataclass
class Member:
    id: str
    addr: str
    capacity: int
    incarnation: int
    used: int = 0
    raft: str = ""  # the node's Raft address
    raft_n: int = 0  # how many voters its Raft group has, as it sees it
    group: str = ""  # the id of its Raft group
    seq: int = 0  # raised by the member itself to refute a suspicion or announce a change
    state: str = ALIVE
    last_ok: float = 0.0  # Membership.clock() of the last sign of life we saw ourselves
    state_since: float = field(default_factory=time.time)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "addr": self.addr, "cap": self.capacity,
                "inc": self.incarnation, "used": self.used, "raft": self.raft,
                "raft_n": self.raft_n, "group": self.group, "seq": self.seq}

    @property
    def version(self) -> tuple[int, int]:
        return self.incarnation, self.seq


def parse_record(rec: Any) -> Member:
    if not (isinstance(rec, dict) and isinstance(rec.get("id"), str)
            and isinstance(rec.get("addr"), str) and isinstance(rec.get("cap"), int)
            and isinstance(rec.get("inc"), int) and isinstance(rec.get("used", 0), int)
            and isinstance(rec.get("raft", ""), str) and isinstance(rec.get("raft_n", 0), int)
            and isinstance(rec.get("group", ""), str) and isinstance(rec.get("seq", 0), int)):
        raise PeerError(f"malformed member record {rec!r:.200}")
    return Member(rec["id"], rec["addr"], rec["cap"], rec["inc"], rec.get("used", 0),
                  rec.get("raft", ""), rec.get("raft_n", 0), rec.get("group", ""),
                  rec.get("seq", 0))


def _nobody(node: str) -> None:
    pass


@dataclass
class _Update:
    kind: str
    rec: dict[str, Any]
    sent: int = 0


def alive_at_raft(ms: Membership, raft_addr: str) -> Member | None:
    """The member whose Raft address is `raft_addr`, if it is alive and not suspected."""
    for m in list(ms.members.values()):
        if m.raft == raft_addr and m.state == ALIVE and m.id not in ms.suspects:
            return m
    return None


class Membership:
    """Attributes:
    on_suspect: called with a node id when it stops answering (cancel what waits on it).
    probes: pings and indirect probes this node sent (per-node cost, for status).
    """

    def __init__(self, me: Member, seeds: list[str], pool: PeerPool, timeout: float,
                 used: Callable[[], int],
                 on_suspect: Callable[[str], None] = _nobody,
                 clock: Callable[[], float] = time.monotonic,
                 overdue: Callable[[], list[str]] = list) -> None:
        self.me = me
        self.clock = clock  # seconds, monotonic (tests run the protocol on trio's clock)
        self.seeds = [s for s in seeds if s != me.addr]
        self.pool = pool
        self.timeout = timeout
        self.interval = min(1.0, timeout / 4)
        self._used = used
        self.members: dict[str, Member] = {}
        self.suspects: set[str] = set()
        self._suspect_since: dict[str, float] = {}
        # members others reach and we do not: since when our direct pings go unanswered,
        # and those we route around for it
        self._direct_miss: dict[str, float] = {}
        self._unreachable_here: set[str] = set()
        self.ring = Ring({me.id: me.capacity})
        self.history: list[tuple[float, Ring]] = []
        self.changes = 0
        self.joined_at = 0.0  # when we joined an existing cluster (0: we formed ours)
        self._without_me: tuple[Ring, Ring] | None = None
        self.on_suspect = on_suspect
        self.overdue = overdue  # members a request has waited on too long: probed first
        self._checked: dict[str, float] = {}  # when each was last probed for that
        self._updates: dict[str, _Update] = {}  # node id -> the latest news of it to spread
        self._order: list[str] = []  # probe order (shuffled round-robin)
        self._urgent: list[str] = []  # members to probe first (a request to them failed)
        self._advertised: tuple[Any, ...] = ()
        self.probes = 0
        self._ring_news = [0, 0]  # members in, out since the last ring line in the log
        self._ring_logged = -RING_LOG_SECONDS

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
        if self.joined_at and self.clock() - self.joined_at < HISTORY_SECONDS:
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
        """Route around `node` until it shows it is alive again, give up on the requests
        still waiting for it, and probe it first."""
        if node != self.me.id and node not in self.suspects:
            log.info("peer %s is not answering: routing around it until it does", node)
            self.suspects.add(node)
            self._suspect_since.setdefault(node, self.clock())
            if node not in self._urgent:
                self._urgent.append(node)
            self.on_suspect(node)

    def _clear_suspicion(self, node: str) -> None:
        self.suspects.discard(node)
        self._suspect_since.pop(node, None)
        self._unreachable_here.discard(node)

    def _path_lost(self, m: Member) -> None:
        """`m` answered an indirect probe, not ours: after half of --peer-timeout of that,
        route around it here (the path from us to it is lost); before, ask it again in
        the next period (one lost ping is not a lost path: on a busy machine a ping
        can miss its half period)."""
        now = self.clock()
        first = self._direct_miss.setdefault(m.id, now)
        if now - first >= self.timeout / 2:
            if m.id not in self._unreachable_here:
                log.warning("peer %s (%s) answers others but not this node for %.1fs: "
                            "routing around it here until it answers us", m.id, m.addr,
                            now - first)
            self._unreachable_here.add(m.id)
            self.suspect(m.id)
        elif m.id in self.suspects and m.id not in self._unreachable_here:
            self._clear_suspicion(m.id)  # (a failed request's suspicion: others reach it)
        if m.id not in self._urgent:
            self._urgent.append(m.id)

    def _rebuild(self) -> None:
        alive = {m.id: m.capacity for m in self.members.values() if m.state == ALIVE}
        alive[self.me.id] = self.me.capacity
        if alive == self.ring.members:
            return
        now = self.clock()
        self.history.append((now, self.ring))
        self.history = [(t, r) for t, r in self.history[-HISTORY_RINGS:]
                        if now - t < HISTORY_SECONDS]
        old = self.ring.members
        self.ring = Ring(alive)
        self.changes += 1
        self._ring_news[0] += len(alive.keys() - old.keys())
        self._ring_news[1] += len(old.keys() - alive.keys())
        log.debug("ring members: %s", ", ".join(sorted(alive)))
        self._log_ring()

    def _log_ring(self, flush: bool = False) -> None:
        """Ring changes, at most one line per RING_LOG_SECONDS: a cluster of N forming
        changes every node's ring N times."""
        joined, left = self._ring_news
        if not (joined or left):
            return
        now = self.clock()
        if now - self._ring_logged < RING_LOG_SECONDS and not (
                flush and now - self._ring_logged >= RING_LOG_SECONDS / 2):
            return
        self._ring_logged = now
        self._ring_news = [0, 0]
        log.info("ring changed: %d members (%d in, %d out)", len(self.ring), joined, left)

    # -- news ------------------------------------------------------------------------------

    def _spread(self, kind: str, m: Member) -> None:
        self._updates[m.id] = _Update(kind, m.record())

    def _gossip(self) -> list[list[Any]]:
        """Up to PIGGYBACK updates, the least sent first; each is dropped once it has been
        sent RETRANSMIT * log2(N + 1) times."""
        if not self._updates:
            return []
        limit = RETRANSMIT * max(1, math.ceil(math.log2(len(self.members) + 2)))
        picked = sorted(self._updates.values(), key=lambda u: u.sent)[:PIGGYBACK]
        out = []
        for u in picked:
            u.sent += 1
            out.append([u.kind, u.rec])
            if u.sent >= limit:
                self._updates.pop(u.rec["id"], None)
        return out

    def _my_record(self) -> dict[str, Any]:
        self.me.used = self._used()
        shown = (self.me.raft, self.me.raft_n, self.me.group)
        if shown != self._advertised:  # a change others route by: raise our version
            if self._advertised:
                self.me.seq += 1
            self._advertised = shown
            self._spread(ALIVE, self.me)
        return self.me.record()

    def _refute(self, seq: int) -> None:
        """Someone says we are suspect or dead at our version: we are not."""
        self.me.seq = max(self.me.seq, seq) + 1
        log.info("refuting a suspicion of this node (now at sequence %d)", self.me.seq)
        self._spread(ALIVE, self.me)

    def _news(self, updates: Any, limit: int = 4 * PIGGYBACK) -> None:
        """Apply gossip: [kind, record] pairs."""
        if not isinstance(updates, list):
            raise PeerError("malformed gossip")
        for u in updates[:limit]:
            if not (isinstance(u, list) and len(u) == 2 and u[0] in KINDS):
                raise PeerError("malformed gossip update")
            self._apply_news(u[0], parse_record(u[1]))

    def _apply_news(self, kind: str, new: Member) -> None:
        if new.id == self.me.id:
            if (kind in ("suspect", DEAD) and new.incarnation == self.me.incarnation
                    and new.seq >= self.me.seq):
                self._refute(new.seq)
            return
        m = self.members.get(new.id)
        if m is not None and new.version < m.version:
            return
        newer = m is None or new.version > m.version
        if kind == ALIVE:
            if not newer and m is not None and m.state != JOINING:
                return  # same version: a dead member is never revived by hearsay
            self._adopt(m, new, ALIVE)
            self._clear_suspicion(new.id)
        elif kind == "suspect":
            if m is None or newer:
                m = self._adopt(m, new, ALIVE)
            if m.state != ALIVE or new.id in self.suspects:
                return
            self.suspect(new.id)
        elif kind == DEAD:
            if m is not None and not newer and m.state in (DEAD, LEFT):
                return
            self._adopt(m, new, DEAD)
            self._clear_suspicion(new.id)
            log.warning("peer %s (%s) is dead (news from another member): taken off the "
                        "ring", new.id, new.addr)
            self.on_suspect(new.id)  # what still waits on it gives up
        else:  # LEFT
            if m is not None and not newer and m.state == LEFT:
                return
            self._adopt(m, new, LEFT)
            self._clear_suspicion(new.id)
            log.info("peer %s (%s) left the cluster", new.id, new.addr)
        self._updates[new.id] = _Update(kind, new.record())  # pass it on
        self._rebuild()

    def _adopt(self, m: Member | None, new: Member, state: str) -> Member:
        """Take `new`'s record (a newer version, or news of a state) with `state`."""
        if m is None or new.version > m.version:
            if m is not None and m.state == ALIVE and m.addr != new.addr:
                log.warning("node %s moved from %s to %s", new.id, m.addr, new.addr)
            if (m is None or m.state != ALIVE) and state == ALIVE:
                log.debug("peer %s (%s) is alive", new.id, new.addr)
            new.last_ok = m.last_ok if m is not None else self.clock()
            new.state_since = m.state_since if m is not None else time.time()
            self.members[new.id] = new
            m = new
        if m.state != state:
            m.state, m.state_since = state, time.time()
        return m

    def _heard_from(self, rec: Any, replied: bool = True) -> Member:
        """A member answered us (`replied`) or called us directly: it is alive. Only an
        answer shows that the path from us to it works."""
        new = parse_record(rec)
        if new.id == self.me.id:
            raise PeerError(f"a peer at {new.addr} claims our node id {new.id!r}")
        m = self.members.get(new.id)
        if m is not None and new.incarnation < m.incarnation:
            raise PeerError(f"node {new.id} at {new.addr} is an old incarnation")
        if m is not None and new.incarnation == m.incarnation and m.state == LEFT:
            raise PeerError(f"node {new.id} left the cluster")
        was = m.state if m is not None else None
        if m is None or new.version > m.version:
            m = self._adopt(m, new, ALIVE)
            self._spread(ALIVE, m)
        else:
            m.addr, m.capacity, m.used = new.addr, new.capacity, new.used
        if m.state != ALIVE:
            log.info("peer %s (%s) is answering again", m.id, m.addr)
            m.state, m.state_since = ALIVE, time.time()
        elif was == ALIVE and m.id in self.suspects and (
                replied or m.id not in self._unreachable_here):
            log.info("peer %s (%s) is answering again", m.id, m.addr)
        m.last_ok = self.clock()
        if replied:
            self._direct_miss.pop(m.id, None)
        if replied or m.id not in self._unreachable_here:
            self._clear_suspicion(m.id)
        self._rebuild()
        return m

    def _what_we_think(self, node: str) -> str:
        """What a member answering us should know: whether we had it suspect or dead."""
        m = self.members.get(node)
        if m is None:
            return ALIVE
        if m.state in (DEAD, LEFT):
            return m.state
        # (one we route around only because our path to it is lost is alive everywhere:
        # nothing for it to refute)
        return "suspect" if node in self.suspects - self._unreachable_here else ALIVE

    def hear_of(self, node: str, addr: str, capacity: int) -> bool:
        """A member known from elsewhere (the Raft log's member records) that we have not
        heard of: reachable by its address at once, probed first, and on the ring once it
        answers. A restarted node with no seed up hears of the others only when they retry
        their seeds, SEED_RETRY_SECONDS later. False if we know it already."""
        if node == self.me.id or node in self.members:
            return False
        self.members[node] = Member(node, addr, capacity, 0, state=JOINING,
                                    last_ok=self.clock())
        self._urgent.append(node)
        return True

    def _view(self) -> list[dict[str, Any]]:
        return [m.record() for m in self.members.values() if m.state == ALIVE]

    def _full_view(self) -> list[list[Any]]:
        return [[ALIVE if m.state in (ALIVE, JOINING) else m.state, m.record()]
                for m in self.members.values()] + [[ALIVE, self._my_record()]]

    def _learn(self, records: Any) -> None:
        """A seed's view of the cluster (a join): its live members, as alive."""
        if not isinstance(records, list):
            raise PeerError("malformed member list")
        for rec in records:
            self._apply_news(ALIVE, parse_record(rec))

    # -- requests from peers --------------------------------------------------------------

    async def handle(self, peer: str, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        rec = msg.get("from")
        if not isinstance(rec, dict) or rec.get("id") != peer:
            raise PeerError(f"{op} from {peer} carries another node's record")
        if op in ("join", "ping", "ping_req"):
            old = self.members.get(peer)
            if (op == "join" and old is not None and old.state == ALIVE
                    and old.addr != rec.get("addr")
                    and self.clock() - old.last_ok < self.timeout):
                return {"error": Conflict.code,
                        "msg": f"node id {peer!r} is already used by the member at {old.addr}"}
            thought = self._what_we_think(peer)
            self._heard_from(rec, replied=False)
            self._news(msg.get("gossip", []))
            if msg.get("thought") in ("suspect", DEAD):
                self._refute(self.me.seq)
            reply: dict[str, Any] = {}
            if op == "join":
                self._learn(msg.get("members", []))
                reply["members"] = self._view()
            elif op == "ping_req":
                reply["ok"] = await self._probe_for(msg)
            if msg.get("sync"):
                reply["view"] = self._full_view()
            if thought != ALIVE:
                reply["thought"] = thought  # so that it refutes it everywhere
            reply.update({"from": self._my_record(), "gossip": self._gossip()})
            return reply
        if op == "leave":
            m = self.members.get(peer)
            if m is not None and m.incarnation == rec.get("inc"):
                if m.state != LEFT:
                    log.info("peer %s (%s) left the cluster", m.id, m.addr)
                m.state, m.state_since = LEFT, time.time()
                self._clear_suspicion(m.id)
                self._spread(LEFT, m)
                self._rebuild()
            return {}
        raise PeerError(f"unknown membership op {op!r}")

    async def _probe_for(self, msg: dict[str, Any]) -> bool:
        """A `ping_req`: probe the named member on the asker's behalf."""
        target = msg.get("target")
        m = self.members.get(target) if isinstance(target, str) else None
        if m is None or m.id == self.me.id:
            return False
        wait = msg.get("wait")
        wait = min(self.timeout, float(wait)) if isinstance(wait, int | float) else \
            self.interval / 2
        return await self._ping_once(m, max(0.05, wait))

    # -- our side -------------------------------------------------------------------------

    async def _join_one(self, addr: str) -> None:
        reply, _ = await self.pool.request(addr, {"op": "join", "from": self._my_record(),
                                                  "members": self._view(),
                                                  "gossip": self._gossip()},
                                           timeout=max(5.0, self.timeout))
        alone = len(self.ring) == 1
        self._heard_from(reply.get("from"))
        self._learn(reply.get("members"))
        self._news(reply.get("gossip", []))
        if alone and len(self.ring) > 1:
            # We joined an existing cluster: what we now own, others cached until now.
            self.joined_at = self.clock()

    async def _expand_seeds(self) -> list[str]:
        """Seeds as addresses, in random order (joins spread over the seeds): a name (a
        Kubernetes headless Service) can stand for every member; our own address is left
        out."""
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
        random.shuffle(out)
        return out

    async def join(self, patience: float = 0.0) -> None:
        """Join through the seed peers; while none answers, try them again for `patience`
        seconds, then form a new cluster. (Members started together: a seed started a
        moment after us does not listen yet. Forming at once made a second Raft group,
        which a member joining through us followed: two namespaces.)"""
        deadline = self.clock() + patience
        while True:
            errors: list[str] = []
            for addr in await self._expand_seeds():
                try:
                    await self._join_one(addr)
                except AuthError as e:
                    raise UserError(f"cluster secret rejected by peer {addr}: every node "
                                    "needs the same --cluster-secret-file") from e
                except PeerError as e:
                    if isinstance(e, Conflict):
                        raise UserError(f"cannot join through {addr}: {e}") from e
                    errors.append(str(e))
                    continue
                log.info("joined the cluster through %s: %d members", addr, len(self.ring))
                return
            if not self.seeds or self.clock() >= deadline:
                break
            await trio.sleep(JOIN_RETRY_SECONDS)
        if self.seeds:
            log.warning("no peer reachable (%s); forming a new cluster",
                        "; ".join(errors))
        else:
            log.info("no peers given; forming a new cluster")

    def _next_target(self) -> Member | None:
        while self._urgent:
            m = self.members.get(self._urgent.pop(0))
            if m is not None and m.state in (ALIVE, JOINING):
                return m
        for _ in range(2):
            while self._order:
                m = self.members.get(self._order.pop())
                if m is not None and m.state in (ALIVE, JOINING):
                    return m
            self._order = [i for i, m in self.members.items() if m.state in (ALIVE, JOINING)]
            random.shuffle(self._order)
        return None

    async def run(self) -> None:
        """The protocol: each period probe one member (and, every few periods, one dead
        member), settle suspicions, and re-try seeds we are not joined to."""
        last_seed_try = self.clock()
        rounds = 0
        busy: set[str] = set()
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(self.interval)
                rounds += 1
                self._check_overdue()
                m = self._next_target()
                if m is not None and m.addr not in busy:
                    busy.add(m.addr)
                    nursery.start_soon(self._probe, m, busy, rounds % SYNC_EVERY == 0)
                if rounds % REVIVE_EVERY == 0:
                    dead = [d for d in self.members.values()
                            if d.state == DEAD and d.addr not in busy]
                    if dead:
                        d = random.choice(dead)
                        busy.add(d.addr)
                        nursery.start_soon(self._probe, d, busy, False)
                self._settle()
                now = self.clock()
                if now - last_seed_try > SEED_RETRY_SECONDS:
                    last_seed_try = now
                    nursery.start_soon(self._retry_seeds, busy)

    def _check_overdue(self) -> None:
        """Members a request waits on past its time are probed next (once per half of the
        timeout each, so a slow answer costs a ping or two, not one every period)."""
        now = self.clock()
        for node in self.overdue():
            if (node in self.suspects or node in self._urgent
                    or now - self._checked.get(node, -math.inf) < self.timeout / 2):
                continue
            self._checked[node] = now
            self._urgent.append(node)
        if len(self._checked) > 4 * len(self.members) + 64:
            self._checked = {n: t for n, t in self._checked.items()
                             if now - t < self.timeout}

    def _settle(self) -> None:
        """Suspects that did not refute within half the timeout are dead; dead members
        are forgotten after a while."""
        self._log_ring(flush=True)
        now = self.clock()
        for node, since in list(self._suspect_since.items()):
            m = self.members.get(node)
            if m is None or m.state != ALIVE:
                self._suspect_since.pop(node, None)
                continue
            if now - since > self.timeout / 2 and now - m.last_ok > self.timeout / 2:
                log.warning("peer %s (%s) has not answered for %.1fs: taken off the ring",
                            m.id, m.addr, now - max(since, m.last_ok))
                m.state, m.state_since = DEAD, time.time()
                self._clear_suspicion(node)
                self._spread(DEAD, m)
                self._rebuild()
        for m in list(self.members.values()):
            if m.state in (DEAD, LEFT) and time.time() - m.state_since > FORGET_DEAD_SECONDS:
                del self.members[m.id]
                self._direct_miss.pop(m.id, None)
            elif m.state == JOINING and now - m.last_ok > self.timeout:
                del self.members[m.id]  # heard of, never reached

    async def _ping_once(self, m: Member, wait: float, sync: bool = False) -> bool:
        """One direct ping; whether `m` answered (and what it said is taken in)."""
        msg: dict[str, Any] = {"op": "ping", "from": self._my_record(),
                               "gossip": self._gossip()}
        if sync:
            msg["sync"] = True
        thought = self._what_we_think(m.id)
        if thought != ALIVE:
            msg["thought"] = thought  # so that it refutes it everywhere
        self.probes += 1
        try:
            reply, _ = await self.pool.request(m.addr, msg, timeout=wait)
            if reply.get("from", {}).get("id") != m.id:
                raise PeerError(f"{m.addr} is now node {reply.get('from')!r:.100}")
            self._heard_from(reply["from"])
            self._news(reply.get("gossip", []))
            if reply.get("thought") in ("suspect", DEAD):
                self._refute(self.me.seq)
            view = reply.get("view")
            if isinstance(view, list):
                self._news(view, limit=len(view))
            return True
        except PeerError as e:
            log.debug("ping %s: %s", m.id, e)
            return False

    async def _probe(self, m: Member, busy: set[str], sync: bool) -> None:
        """SWIM's probe: direct, then through up to INDIRECT other members."""
        try:
            if await self._ping_once(m, max(0.05, self.interval / 2), sync):
                return
            if self.members.get(m.id) is not m or m.state != ALIVE:
                return  # a dead member's revival probe: no indirect probes
            helpers = [h for h in self.members.values()
                       if h.state == ALIVE and h.id != m.id and h.id not in self.suspects]
            ok = False
            if helpers:
                ok = await self._indirect(m, random.sample(helpers, min(INDIRECT,
                                                                        len(helpers))))
            if self.members.get(m.id) is not m or m.state != ALIVE:
                return
            if ok:
                m.last_ok = self.clock()
                self._path_lost(m)
            elif m.id not in self.suspects or m.id in self._unreachable_here:
                self._unreachable_here.discard(m.id)
                self.suspect(m.id)
                self._spread("suspect", m)
        finally:
            busy.discard(m.addr)

    async def _indirect(self, m: Member, helpers: list[Member]) -> bool:
        answered = False
        wait = max(0.05, self.interval / 2)

        async def ask(h: Member, cancel: trio.CancelScope) -> None:
            nonlocal answered
            self.probes += 1
            try:
                reply, _ = await self.pool.request(
                    h.addr, {"op": "ping_req", "from": self._my_record(), "target": m.id,
                             "wait": wait, "gossip": self._gossip()}, timeout=wait * 2 + 0.5)
                self._heard_from(reply.get("from"))
                self._news(reply.get("gossip", []))
                if reply.get("ok") is True:
                    answered = True
                    cancel.cancel()
            except PeerError as e:
                log.debug("ping_req %s via %s: %s", m.id, h.id, e)

        async with trio.open_nursery() as nursery:
            for h in helpers:
                nursery.start_soon(ask, h, nursery.cancel_scope)
        return answered

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
        request or a probe are "suspect"."""
        return "suspect" if m.state == ALIVE and m.id in self.suspects else m.state

    def status(self) -> list[dict[str, Any]]:
        shares = self.ring.shares()
        now = self.clock()
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
