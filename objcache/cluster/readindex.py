"""Read barriers that commit no log entry (Raft's ReadIndex, section 6.4 of Ongaro's thesis).

A read that must see every close committed anywhere before it (an open, a lookup that found
nothing, a listing) used to commit a no-op through the log and wait until this node had
applied it. Every member applies every entry, so each barrier cost the whole cluster one
entry: at 32 nodes, one of the four entries of a close-to-open round trip.

Here the reader asks the leader instead (`raft_read_index`), and the leader answers with
an index after two checks:
- it has committed an entry in its current term (pysyncobj commits a no-op on election),
  so its commit index covers every entry committed by the leaders before it. This member
  remembers the commit index it first saw as leader of a term; only a higher one later
  proves such a commit (pysyncobj advances a leader's commit index only with entries of
  its own term). Until then it answers nothing and the reader commits a no-op, which is
  that entry;
- after the request arrived, a majority of the voters (itself included) answered
  `raft_term` with its term. A leader of a later term needs the votes of a majority, and
  each voter's term only grows, so at least one voter it needs had not voted for it when
  it answered: no other leader had been elected when the request arrived, and the commit
  index read before the round holds every write acknowledged by then.
The answer is the index of the last command the leader has applied at or after that commit
index (pysyncobj's own entries, no-ops and membership changes, change no state and are not
handed to the node), and the reader waits until it has applied that far (a voter from its
own log). A learner says what it has applied, and the entries after that up to the index
come with the answer, from the leader's feed: without them it waited for its own feed,
which brings them only once a follower has learned of the commit and applied them.

A round is also a lease (Raft thesis 6.4.1): each voter's answer carries a promise to
vote for no candidate and to stand for no election for PROMISE seconds
(objcache/raft/follower_fix.py, 4.), and the leader promises the same. When a majority
(itself included) promised in its term, no other leader can be elected before LEASE after
the round began (the promises began after it; LEASE < PROMISE leaves room for clocks that
run at different rates), so until then the leader answers from its commit index at once:
the reader's barrier costs the reader and the leader, not a question to the voters for
every read. While reads come, the leader renews the lease before it ends, in the
background; a handover (`RaftNode.step_down`) ends it. At 32 nodes on two cores the
question to the voters was a third of a read barrier's time (docs/benchmarks.md).

Concurrent requests share a round, as concurrent barriers shared a no-op: a round that
started after a request arrived answers it. Anything that fails (no leader known, a new
leader, no majority within READ_ROUND_WAIT, a term that moved) answers None, and the
caller falls back to the no-op barrier, so a fault costs what it cost before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from objcache.cluster.learner import FEED_REPLY_BYTES, Learner
from objcache.cluster.membership import alive_at_raft
from objcache.errors import NoQuorum
from objcache.raft.node import RaftNode
from objcache.rounds import SharedRounds

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Member, Membership
    from objcache.cluster.peers import Handler, Reply

log = logging.getLogger(__name__)

READ_ROUND_WAIT = 0.5  # a leader waits this long for a majority to confirm its term
TERM_ASK_TIMEOUT = 5.0  # one voter's answer (the round does not wait for all of them)
LEADER_APPLY_WAIT = 0.5  # the leader applies what it committed within this, or no answer
PROMISE = 0.5  # what a voter promises in its answer (seconds: see the module docstring)
LEASE = 0.4  # from the start of the round that gathered a majority of promises
RENEW_AHEAD = 0.2  # a read within this of the lease's end starts the next round


@dataclass(frozen=True)
class Lease:
    term: int
    group: str
    until: float  # trio time
    handovers: int  # RaftNode.handovers when the round began


class ReadIndex:
    """Attributes (counts for status):
    confirmed: barriers passed with a read index.
    fallbacks: barriers that had to commit a no-op instead.
    served: read indexes this member answered as leader.
    leased: of those (and of its own barriers), answered under a lease, with no round.
    """

    def __init__(self, membership: Membership, client: PeerClient,
                 current: Callable[[], RaftNode | Learner | None], group: Callable[[], str],
                 wait_applied: Callable[[int, float, bool], Awaitable[None]]) -> None:
        self.membership = membership
        self.client = client
        self._current = current
        self._group = group
        self._wait_applied = wait_applied
        self._nursery: trio.Nursery | None = None
        self._lead = (0, 0)  # (term, commit index first seen while leading in it)
        self._rounds = SharedRounds[int | None]()
        self._asking: set[str] = set()  # voters asked for their term that have not answered
        self._lease: Lease | None = None
        self._renewing = False
        self.confirmed = 0
        self.fallbacks = 0
        self.served = 0
        self.leased = 0

    def bind(self, nursery: trio.Nursery) -> None:
        """The nursery the voters' answers finish in (a round does not wait for all)."""
        self._nursery = nursery

    def routes(self) -> dict[str, Handler]:
        return {"raft_read_index": self._serve, "raft_term": self._term}

    def status(self) -> dict[str, int]:
        return {"confirmed": self.confirmed, "fallbacks": self.fallbacks,
                "served": self.served, "leased": self.leased}

    # -- the reader -----------------------------------------------------------------------

    async def barrier(self, timeout: float) -> bool:
        """Wait until this node has applied everything committed before the call, without a
        log entry; False if that could not be done within `timeout` (commit a no-op)."""
        deadline = trio.current_time() + timeout
        index: int | None = None
        with trio.move_on_at(deadline):
            index = await self._index()
        if index is not None:
            try:
                await self._wait_applied(index, deadline, True)
                self.confirmed += 1
                return True
            except NoQuorum:
                pass
        self.fallbacks += 1
        return False

    async def _index(self) -> int | None:
        cur = self._current()
        if cur is None:
            return None
        if isinstance(cur, RaftNode) and cur.leading() is not None:
            return await self._confirmed(cur)
        leader = cur.feed_header().leader
        m = self._member_at(leader) if leader else None
        if m is None or m.id == self.membership.me.id:
            return None
        group = self._group()
        learning = isinstance(cur, Learner)
        ask: dict[str, Any] = {"op": "raft_read_index", "group": group}
        if learning:
            ask["after"] = cur.applied_index()
        got = await self.client.call(m.id, ask, max_data=FEED_REPLY_BYTES if learning else 0,
                                     timeout=TERM_ASK_TIMEOUT)
        index = None if got is None else got[0].get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            return None
        if learning and got is not None and got[1] is not None:
            await cur.take(got[1], index, group)
        return index

    def _member_at(self, raft_addr: str) -> Member | None:
        return alive_at_raft(self.membership, raft_addr)

    # -- the leader -----------------------------------------------------------------------

    async def _serve(self, peer: str, msg: dict[str, Any]) -> Reply:
        cur = self._current()
        group = msg.get("group")
        index = None
        if (isinstance(cur, RaftNode) and cur.leading() is not None
                and (not isinstance(group, str) or not group or group == self._group())):
            with trio.move_on_after(READ_ROUND_WAIT + LEADER_APPLY_WAIT):
                index = await self._confirmed(cur)
        if index is None:
            return {"index": None}, None
        self.served += 1
        # A learner's read waits until it has applied `index`: the entries it lacks come
        # with the answer, where its feed would bring them only once a follower had
        # learned of the commit, applied the entries and answered (one more hop, on
        # another process that may be waiting for a core).
        after = msg.get("after")
        if (isinstance(after, int) and not isinstance(after, bool) and isinstance(cur, RaftNode)
                and group == self._group()):
            data = cur.feed.packed_through(after, index, FEED_REPLY_BYTES)
            if data is not None:
                return {"index": index, "data": len(data)}, data
        return {"index": index}, None

    async def _term(self, peer: str, msg: dict[str, Any]) -> Reply:
        cur = self._current()
        group = msg.get("group")
        if not isinstance(cur, RaftNode) or (isinstance(group, str) and group
                                             and group != self._group()):
            return {"term": None}, None
        seconds, term = msg.get("promise"), msg.get("term")
        if (isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds > 0
                and isinstance(term, int) and not isinstance(term, bool)):
            now, promised = await cur.promise(float(seconds), term)
            return {"term": now, "promised": promised}, None
        return {"term": cur.term()}, None

    async def _confirmed(self, node: RaftNode) -> int | None:
        """A read index: under the lease, at once; otherwise from a round that started
        after this call (shared by the callers that arrive while one runs)."""
        lead = node.leading()
        lease = self._lease
        now = trio.current_time()
        # (a round makes a lease only once the leader has committed in its term: see
        # `_round`; a term is led once at most)
        if (lead is not None and lease is not None and now < lease.until
                and lease.term == lead[0] and lease.group == self._group()
                and lease.handovers == node.handovers and not node.handing_over):
            if lease.until - now < RENEW_AHEAD and not self._renewing and self._nursery:
                self._renewing = True
                self._nursery.start_soon(self._renew, node)
            index = await self._index_at(node, lead)
            if index is not None:
                self.leased += 1
            return index
        return await self._rounds.join(lambda: self._round(node))

    async def _renew(self, node: RaftNode) -> None:
        try:
            await self._rounds.join(lambda: self._round(node))
        finally:
            self._renewing = False

    async def _round(self, node: RaftNode) -> int | None:
        lead = node.leading()
        if lead is None:
            return None
        term, commit = lead
        if self._lead[0] != term:
            self._lead = (term, commit)
            return None
        if commit <= self._lead[1]:
            return None  # nothing of this term committed yet (see the module docstring)
        began, group, handovers = trio.current_time(), self._group(), node.handovers
        voters = node.members()
        others = [a for a in voters if a != node.addr]
        confirmed, promised = await self._majority_at(node, term, others, len(voters) // 2,
                                                      promise=not node.handing_over)
        if not confirmed:
            return None
        if promised:
            self._lease = Lease(term, group, began + LEASE, handovers)
        return await self._index_at(node, lead)

    async def _index_at(self, node: RaftNode, lead: tuple[int, int]) -> int | None:
        """The read index once the leader has applied its commit index `lead[1]` (read when
        the request had arrived), if it still leads in that term."""
        term, commit = lead
        with trio.move_on_after(LEADER_APPLY_WAIT):
            while node.applied_index() < commit:
                await trio.sleep(0.001)
        again = node.leading()
        if node.applied_index() < commit or again is None or again[0] != term:
            return None
        last = node.last_command()
        return last if last > 0 else None

    async def _majority_at(self, node: RaftNode, term: int, others: list[str], need: int,
                           promise: bool = True) -> tuple[bool, bool]:
        """Whether `need` of `others` answer that their term is `term`, within
        READ_ROUND_WAIT; and whether `need` of them promised in it, and we did too (a
        lease; no promise is asked while we hand over the leadership)."""
        if self._nursery is None:
            return need <= 0, False
        yes = promised = answered = 0
        mine: bool | None = None  # our own promise: not yet known
        enough = trio.Event()
        group = self._group()

        def check() -> None:
            if mine is not None and (yes >= need or answered == len(others)):
                enough.set()

        async def ask(addr: str) -> None:
            nonlocal yes, promised, answered
            m = self._member_at(addr)
            got = None
            # One question at a time per voter: a voter cut off (not yet suspected) would
            # otherwise collect a question from every round until its timeout.
            if m is not None and addr not in self._asking:
                self._asking.add(addr)
                try:
                    got = await self.client.call(m.id, question, max_data=0,
                                                 timeout=TERM_ASK_TIMEOUT)
                finally:
                    self._asking.discard(addr)
            answered += 1
            if got is not None and got[0].get("term") == term:
                yes += 1
                promised += got[0].get("promised") is True
            check()

        async def own() -> None:
            nonlocal mine
            mine = await node.promise(PROMISE, term) == (term, True)
            check()

        question: dict[str, Any] = {"op": "raft_term", "group": group}
        if promise:
            question["promise"], question["term"] = PROMISE, term
            self._nursery.start_soon(own)
        else:
            mine = False
        for addr in others:
            self._nursery.start_soon(ask, addr)
        with trio.move_on_after(READ_ROUND_WAIT):
            await enough.wait()
        return yes >= need, mine is True and promised >= need
