"""This node's place in the cluster's one Raft group: a voter or a learner; getting in,
staying in, leaving, and who votes.

At most `max_voters` members (--raft-voters, default 5) vote; every other member is a
learner (objcache.cluster.learner): it follows the committed log from a voter and sends
its commands through it, and the leader's work per commit stays that of `max_voters`
members however large the cluster grows.

- Getting in: a starting node with nobody to ask forms a group of one (a voter, with a
  new group id). Any other starting node becomes a learner of the largest group it sees:
  it takes a snapshot of the state from a member and follows the log from then on, with
  no change to the group's configuration, so a join costs the voters nothing.
- Who votes: the leader keeps the voters at `max_voters` while there are learners. It
  promotes a learner (`raft_promote`: the learner starts a voter with a fresh journal and
  the leader adds it; the learner keeps serving from its own state until the voter has
  applied as far, then hands over), removes a voter that left, removes a dead voter when
  a learner can take its place (then promotes one), and removes voters beyond
  `max_voters`. One change at a time, each through the log.
- Leaving the vote: a voter that was removed (the leader tells it with `raft_demote`, or it
  finds out when it has had no leader for a while and a member names the voters without
  it) becomes a learner, starting from its own applied state.
- Nodes started at the same moment may each form a group of one: a lone voter whose log
  holds only its start-up entries yields to a larger group, or to the lone group with the
  lower id, and becomes its learner, so the cluster converges on one group.
- A node that leaves cleanly is removed by the leader (a leader cannot remove itself; it
  steps down first and its successor does). A crashed voter stays in the group while no
  learner can replace it, and rejoins with its journal when restarted; a learner keeps
  nothing on disk and starts from a snapshot.
- A voter that starts with an empty journal in a group that has a log (a promoted learner,
  a voter whose cache dir was wiped) neither votes nor stands for election until it has
  caught up with the leader, and a wiped voter, whose address the group counts already,
  acknowledges nothing until then (objcache/raft/follower_fix.py).

What the state machine is, and what applying a command means to this node's caches, is
the caller's (objcache.txn): commands applied (on pysyncobj's thread in a voter, on the
trio thread in a learner) are handed to the trio thread through the `applied` feed, in
log order, each once, whoever applied it.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from objcache.cluster.learner import FEED_REPLY_BYTES, Learner
from objcache.cluster.membership import ALIVE, DEAD, LEFT, Member
from objcache.cluster.peers import field_int, field_str, split_addr
from objcache.cluster.readindex import ReadIndex
from objcache.errors import NoQuorum, ObjcacheError, PeerError, ProtocolError
from objcache.raft.node import COMPACT_ENTRIES, RaftNode, StateMachine, pack_entries
from objcache.ticks import next_tick, sleep_ticks

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Membership
    from objcache.cluster.peers import Handler, PeerPool, Reply

log = logging.getLogger(__name__)

LONE_GROUP_ENTRIES = 8  # a Raft group of one this short holds only its own start-up
CATCH_UP_WAIT = 60.0  # mount after this long even if the log is not caught up yet
MAX_VOTERS = 5
PROMOTE_WAIT = 120.0  # a promoted learner's voter has this long to catch up
PROMOTE_RETRY = 30.0  # a learner that failed a promotion is not asked again this long
LEADERLESS_CHECK = 3.0  # a voter without a leader this long asks whether it still votes
MAX_FEED_WAIT = 10.0
MAX_LINGER = 1.0
FORM_WAIT = 3.0  # a starting node lets a member with a lower id form the group this long
SUPERVISE_POLL = 0.25  # how often a waiting supervisor looks for a change to act on
MAX_SUBMIT_COMMANDS = 10_000
T = TypeVar("T")

RaftMember = RaftNode | Learner


class _Tag:
    """Identifies which of our members (the learner, the voter being promoted) applied a
    command: only the current one's are handed on."""


class AppliedFeed(Generic[T]):
    """What the Raft member applied, for the trio thread, in log order: `put` (run by
    pysyncobj's thread through `run_sync_soon`, whose callbacks run in order) appends,
    `take` returns everything so far, and `wait` returns once there is something without
    taking it. (A trio memory channel hands an item to a receiver that waits for it
    directly: until that task runs, the item is in no buffer, and a `take` by another
    task (a read barrier that returned at the same moment) applied the changes after it
    first. A node catching up with the log after a cut applied an unlink before the
    rename that made the name, and listed the unlinked name for good: the partition
    nemesis, seed 2116.)"""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._lot = trio.lowlevel.ParkingLot()

    def put(self, item: T) -> None:
        self._items.append(item)
        self._lot.unpark_all()

    def take(self) -> list[T]:
        items, self._items = self._items, []
        return items

    async def wait(self) -> None:
        while not self._items:
            await self._lot.park()


class RaftGroup(Generic[T]):
    """Attributes:
    ready: a first barrier passed: our member has applied the cluster's log (what we show
        is not a stale or empty view).
    applied: what `extract` took from each applied command, in log order (trio thread).
    raft: our member as the rest of the node uses it (submit, status, state): the voter or
        the learner.
    group: the group's id (the founder's node id and a random suffix).
    """

    def __init__(self, membership: Membership, client: PeerClient, pool: PeerPool,
                 raft_addr: str, raft_dir: Path, secret: str,
                 new_state: Callable[[], StateMachine],
                 extract: Callable[[Any, dict[str, Any]], T | None],
                 catch_up_wait: float = CATCH_UP_WAIT, max_voters: int = MAX_VOTERS,
                 compact_entries: int = COMPACT_ENTRIES) -> None:
        self.catch_up_wait = catch_up_wait
        self.compact_entries = compact_entries
        self.max_voters = max(1, max_voters)
        self.membership = membership
        self.client = client
        self.pool = pool
        self.addr = raft_addr
        self.dir = raft_dir
        self.secret = secret
        self.new_state = new_state
        self.extract = extract
        self.group = ""
        self.voter: RaftNode | None = None
        self.learner: Learner | None = None
        self._current: RaftMember | None = None
        self._current_tag: _Tag | None = None
        self._promoting: RaftNode | None = None
        self._promoting_tag: _Tag | None = None
        self._held: list[tuple[int, T | None]] = []
        self._deliver_lock = threading.Lock()
        self._closed = False
        self._leaving = False
        self.ready = False
        self.promotions = 0
        self.demotions = 0
        self.applied = AppliedFeed[T]()
        self._applied_index = 0
        self._applied_event = trio.Event()
        self._feed_event = trio.Event()
        self._feed_waiting = False
        self._hurry: dict[str, trio.Event] = {}  # learners whose feed request lingers
        self._hurried: set[str] = set()  # ...and those that hurried one not here yet
        self._leaderless_since: float | None = None
        # Voters without their logs, while too few voters with one are left to elect a
        # leader (`_check_still_voter`); None while that is not the case.
        self.without_log: list[str] | None = None
        self._promote_failed: dict[str, float] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._trio_thread = 0
        self._nursery: trio.Nursery | None = None
        self.reads = ReadIndex(membership, client, lambda: self._current, lambda: self.group,
                               self.wait_applied)

    def routes(self) -> dict[str, Handler]:
        return {"raft_members": self._members, "raft_add": self._change,
                "raft_remove": self._change, "raft_feed": self._feed,
                "raft_submit": self._submit, "raft_promote": self._promote,
                "raft_demote": self._demote_request, "raft_feed_now": self._feed_now,
                **self.reads.routes()}

    @property
    def raft(self) -> RaftMember | None:
        return self._current

    @property
    def state(self) -> Any:
        """The replicated state as this member has applied it (None before it runs)."""
        return self._current.state if self._current is not None else None

    # -- running --------------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Enter the group, then wait (bounded) until we have caught up with its log."""
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._nursery = nursery
        self.reads.bind(nursery)
        await self._enter_group()
        # (back without our log at an address the group counts: not a new member being
        # promoted, which the group counts only once its voter started)
        counted = self._counted_not_voting()
        nursery.start_soon(self._supervise)
        t0 = trio.current_time()
        if not await self._catch_up(self.catch_up_wait):
            log.warning("could not catch up with the cluster's log in %.0fs; mounting anyway "
                        "(changes appear as they are applied; write-back waits until "
                        "caught up)", self.catch_up_wait)
            nursery.start_soon(self._catch_up, math.inf)
        elif counted and not await self._wait_voting(t0 + self.catch_up_wait):
            log.warning("the group counts this node as a voter, and its voter has not caught "
                        "up with the log in %.0fs; mounting anyway (the group has one "
                        "voter fewer until it does)", self.catch_up_wait)

    def _counted_not_voting(self) -> bool:
        """Whether the group counts our address as a voter while our member cannot vote
        yet (restarted without its log, or before its voter caught up)."""
        cur = self._current
        if isinstance(cur, Learner):
            return self._promoting is not None or self.addr in cur.voters
        return isinstance(cur, RaftNode) and not cur.voting

    async def _wait_voting(self, deadline: float) -> bool:
        """Until we are not `_counted_not_voting`, at most until `deadline`: a node is
        ready (mounted) only once the group's voters it counts all hold the log again."""
        with trio.move_on_at(deadline):
            while self._counted_not_voting():
                await trio.sleep(0.1)
            return True
        return False

    async def _catch_up(self, timeout: float) -> bool:
        """Until a barrier passes through the log (then `ready`), at most `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self._current is not None:
                try:
                    await self._current.submit({"op": "ns.noop"}, timeout=5)
                    self.ready = True
                    log.info("caught up with the cluster's log in %.2fs",
                             time.monotonic() - t0)
                    return True
                except NoQuorum as e:
                    log.info("waiting for the cluster's log: %s", e)
            await trio.sleep(0.2)
        return False

    def has_log(self) -> bool:
        """Whether this member was a voter before (restarted with its cache dir)."""
        return (self.dir / "partners.json").exists()

    async def _enter_group(self) -> None:
        if self.has_log():  # restarted with our cache dir: replay
            self._load_group()
            self._become_voter(json.loads((self.dir / "partners.json").read_text()))
            return
        best = self._best_group()
        # A node that joined through others forms a group only when it learns of none
        # within FORM_WAIT (all members starting at once, from zero), and then only the
        # one with the lowest id; the others wait for it (3x as long at most). A seed that
        # is joining too knows no group yet: a node that joined through one formed a second
        # group at once, and the learners that found it first followed it (two namespaces).
        started = trio.current_time()
        while best is None and self.membership.members:
            lower = any(m.state == ALIVE and m.raft and m.id < self.membership.me.id
                        for m in self.membership.members.values())
            if trio.current_time() - started >= FORM_WAIT * (3 if lower else 1):
                break
            await trio.sleep(0.2)
            best = self._best_group()
        if best is None:
            self.group = f"{self.membership.me.id}/{uuid.uuid4().hex[:12]}"
            self._become_voter([])
            return
        await self._become_learner_of(best)

    # -- handing applied commands to the node ---------------------------------------------

    def _applied_by(self, tag: _Tag, machine: Any, cmd: dict[str, Any], index: int) -> None:
        """After each applied command, on the applying member's thread."""
        item = self.extract(machine, cmd)
        with self._deliver_lock:
            if tag is self._current_tag:
                if threading.get_ident() == self._trio_thread:
                    self._deliver(item, index)
                elif self._token is not None:
                    try:
                        self._token.run_sync_soon(self._deliver, item, index)
                    except trio.RunFinishedError:
                        pass
            elif tag is self._promoting_tag and index > self._learner_applied():
                self._held.append((index, item))

    def _learner_applied(self) -> int:
        return self.learner.applied if self.learner is not None else 0

    def _deliver(self, item: T | None, index: int) -> None:
        if item is not None:
            self.applied.put(item)
        self._advance(index)

    def _advance(self, index: int) -> None:
        if index > self._applied_index:
            self._applied_index = index
            self._applied_event.set()
            self._applied_event = trio.Event()

    def _progress_of(self, tag: _Tag) -> Callable[[int], None]:
        def progress(index: int) -> None:
            if tag is self._current_tag:
                self._advance(index)
        return progress

    async def wait_applied(self, index: int, deadline: float, active: bool = True) -> None:
        """Until this node has applied log index `index`; NoQuorum at `deadline`.
        `active`: a user here waits (a read barrier, a close), not write-back."""
        learner = self.learner
        if learner is not None and learner is self._current:
            if active:
                learner.active()
            if self._applied_index < index and self._nursery is not None:
                self._nursery.start_soon(learner.hurry, index)
        while self._applied_index < index:
            if trio.current_time() >= deadline:
                raise NoQuorum(f"log index {index} was committed but not applied here in "
                               "time")
            with trio.move_on_at(deadline):
                await self._applied_event.wait()

    def _wake_feed(self) -> None:
        """A member applied an entry (any thread): answer the feed requests waiting."""
        if self._feed_waiting and self._token is not None:
            self._feed_waiting = False
            try:
                self._token.run_sync_soon(self._pulse_feed)
            except trio.RunFinishedError:
                pass

    def _pulse_feed(self) -> None:
        self._feed_event.set()
        self._feed_event = trio.Event()

    # -- becoming a voter or a learner ----------------------------------------------------

    def _save_group(self, partners: list[str]) -> None:
        """pysyncobj's journal records membership changes relative to the partners it
        started with, so a restart with the same cache dir must start from the same
        list."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "partners.json").write_text(json.dumps(partners))
        (self.dir / "group.json").write_text(json.dumps({"group": self.group}))

    def _load_group(self) -> None:
        try:
            self.group = str(json.loads((self.dir / "group.json").read_text())["group"])
        except (OSError, ValueError, KeyError, TypeError):
            self.group = ""  # a journal from before groups had ids

    def _new_voter(self, partners: list[str], tag: _Tag, joining: bool = False,
                   wiped: bool = False) -> RaftNode:
        """`joining`: our journal is empty and the group's log is not; we do not vote until
        caught up. `wiped`: the group counts our address as a voter already; we do not
        count toward a commit until caught up either."""
        node = RaftNode(self.addr, partners, self.dir, self.secret, self.new_state(),
                        lambda m, c, i: self._applied_by(tag, m, c, i),
                        joining=joining, wiped=wiped, compact_entries=self.compact_entries)
        # (after the node: a restart finds partners.json only beside a journal that knows
        # whether it was still joining)
        self._save_group(partners)
        node.feed.on_add = self._wake_feed
        log.info("raft member %s started with partners %s", self.addr, partners or "none")
        return node

    def _become_voter(self, partners: list[str]) -> None:
        tag = _Tag()
        with self._deliver_lock:
            self._current_tag = tag
        node = self._new_voter(partners, tag)
        self.voter, self._current = node, node

    async def _voters_of(self, m: Member) -> tuple[list[str], str]:
        got = await self.client.call(m.id, {"op": "raft_members"}, max_data=0, timeout=10.0)
        found = None if got is None else got[0].get("members")
        group = None if got is None else got[0].get("group")
        # (our own address too, as the feed's answers name it: a node back without its
        # cache dir sees at once that the group counts it, and starts its voter 2 s sooner)
        voters = [str(a) for a in found] if isinstance(found, list) else []
        return voters, group if isinstance(group, str) else ""

    async def _become_learner_of(self, best: Member | None,
                                 state: StateMachine | None = None, applied: int = 0,
                                 voters: list[str] | None = None) -> None:
        """Follow the log of `best`'s group: from `state` at index `applied` (our own, if
        we were a voter of that group) or from a snapshot."""
        group = self.group if state is not None else ""
        if voters is None:
            voters = []
            if best is not None:
                voters, group = await self._voters_of(best)
        tag = _Tag()
        learner = Learner(self.client, self.membership,
                          state if state is not None else self.new_state(), voters, group,
                          lambda m, c, i: self._applied_by(tag, m, c, i),
                          self.wait_applied, self._progress_of(tag), applied)
        learner.feed.on_add = self._wake_feed
        with self._deliver_lock:
            self.learner, self._current, self._current_tag = learner, learner, tag
        self.group = group
        self._advance(applied)
        assert self._nursery is not None
        self._nursery.start_soon(learner.run)
        log.info("raft: following the log as a learner (voters %s)", voters or "unknown yet")

    def _best_group(self) -> Member | None:
        """A member of the group to join: the largest group, then the lowest group id
        (members whose group we are in do not count)."""
        others = [m for m in self.membership.members.values()
                  if m.state == ALIVE and m.raft and m.raft_n >= 1
                  and (not self.group or m.group != self.group)]
        return min(others, key=lambda m: (-m.raft_n, m.group, m.id), default=None)

    # -- promotion and demotion -----------------------------------------------------------

    async def _promote(self, peer: str, msg: dict[str, Any]) -> Reply:
        """The leader asks us to vote: start a voter (the leader adds it next)."""
        voters = msg.get("voters")
        if not (isinstance(voters, list) and all(isinstance(v, str) for v in voters)):
            raise ProtocolError("raft_promote needs the voters")
        if self._leaving:
            # Between the group's removing us and our LEFT reaching the leader, we still
            # look like a learner of its group: voting again would count a member that is
            # about to stop (a group of two with one of them gone has no quorum).
            raise PeerError("this node is leaving the cluster")
        if isinstance(self._current, RaftNode) or self._promoting is not None:
            return {"ok": True}, None
        if self.learner is None:
            raise PeerError("raft is not running here yet")
        group = msg.get("group")
        if isinstance(group, str) and group and self.group and group != self.group:
            raise PeerError(f"we follow group {self.group}, not {group}")
        self._begin_promotion([v for v in voters if v != self.addr], self.addr in voters)
        return {"ok": True}, None

    def _begin_promotion(self, voters: list[str], wiped: bool = False) -> None:
        """`wiped`: the group counts our address as a voter already (a restart without
        our journal, a promotion we gave up): the leader may believe we hold entries we
        no longer have."""
        log.info("raft: promoted to voter; starting a voter with partners %s", voters)
        shutil.rmtree(self.dir, ignore_errors=True)  # a fresh journal: the leader sends it
        tag = _Tag()
        node = self._new_voter(voters, tag, joining=bool(voters), wiped=wiped and bool(voters))
        with self._deliver_lock:
            self._promoting, self._promoting_tag = node, tag
        assert self._nursery is not None
        self._nursery.start_soon(self._hand_over, node, tag)

    def _give_up_promotion(self, node: RaftNode) -> None:
        """The learner goes on serving; the voter that was to replace it goes."""
        with self._deliver_lock:
            self._promoting = self._promoting_tag = None
            self._held = []
        node.destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _hand_over(self, node: RaftNode, tag: _Tag) -> None:
        """Once the new voter has a leader, votes and has applied as far as the learner, it
        becomes this node's member; until then the learner serves."""
        deadline = trio.current_time() + PROMOTE_WAIT
        nudged = trio.current_time()
        counted = False  # the group has counted us as a voter since this promotion began
        first = set(self.learner.voters) if self.learner is not None else set()
        while True:
            if self._promoting is not node:
                return
            voters = self.learner.voters if self.learner is not None else []
            counted = counted or self.addr in voters
            if counted and self.addr not in voters:
                # Removed meanwhile (a voter restarted with its journal starts its voter at
                # once, and the leader, which had taken it for dead, removed it 65 ms later:
                # seed 5004). Waiting out PROMOTE_WAIT left it "promoting" for 120 s.
                log.info("raft: the group no longer counts this node as a voter; staying "
                         "a learner")
                self._give_up_promotion(node)
                return
            if (not counted and len(voters) >= self.max_voters
                    and set(voters) != first):
                # The voters changed to a full set without us: the leader filled the
                # place with another learner. It makes one change at a time, so it no
                # longer means to add us; a request that gave up on us and still reached
                # us after a cut healed started this promotion (seed 5103: "promoting"
                # for 120 s). (Full without us from the start is not enough: our view
                # may not yet show the removal that made the place.)
                log.info("raft: the group filled its voters without this node; staying a "
                         "learner")
                self._give_up_promotion(node)
                return
            st = node.status()
            if st["leader"] and not node.voting and trio.current_time() - nudged > 1.0:
                # It votes once it holds a commit the leader made after it first heard from
                # it; an idle group makes none: one no-op through the learner.
                nudged = trio.current_time()
                with trio.move_on_after(2.0):
                    try:
                        if self.learner is not None:
                            await self.learner.submit({"op": "ns.noop"}, timeout=2.0)
                    except NoQuorum:
                        pass
                continue
            # (voting: until then the group has one voter fewer than it counts, and this
            # node must not look ready: a second node restarted without its cache dir
            # meanwhile left a group of three with one voter holding the log, and none
            # could be elected again: the partition nemesis, seeds 1953 and 1971)
            if (st["leader"] and node.voting
                    and node.applied_index() >= self._learner_applied()):
                break
            if trio.current_time() > deadline:
                log.warning("raft: the new voter did not catch up in %.0fs; staying a "
                            "learner", PROMOTE_WAIT)
                self._give_up_promotion(node)
                return
            await trio.sleep(0.1)
        learner = self.learner
        assert learner is not None
        learner.stop()
        with self._deliver_lock:
            floor = learner.applied
            self._current, self._current_tag = node, tag
            self.voter, self.learner = node, None
            self._promoting = self._promoting_tag = None
            held, self._held = self._held, []
        for index, item in held:
            if index > floor:
                self._deliver(item, index)
        self._advance(node.applied_index())
        self.promotions += 1
        log.info("raft: now a voter (handed over at log index %d)", floor)

    async def _demote(self, why: str) -> None:
        """Stop voting: follow the log as a learner, from our own applied state."""
        node = self.voter
        if node is None or self._current is not node:
            return
        log.info("raft: no longer a voter (%s); following the log as a learner", why)
        voters = [a for a in node.members() if a != self.addr]
        with self._deliver_lock:
            self._current = self._current_tag = None
        await trio.to_thread.run_sync(node.destroy_synchronous)
        state, applied = node.state, node.applied_index()
        self.voter = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.demotions += 1
        await self._become_learner_of(None, state, applied, voters)

    async def _demote_request(self, peer: str, msg: dict[str, Any]) -> Reply:
        group = msg.get("group")
        if isinstance(group, str) and group and self.group and group != self.group:
            raise PeerError(f"we are in group {self.group}, not {group}")
        if self.voter is not None and self._current is self.voter:
            # not from inside the request: destroying the voter takes a moment
            assert self._nursery is not None
            self._nursery.start_soon(self._demote, f"removed by {peer}")
        return {"ok": True}, None

    # -- supervising ----------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Stay in the cluster's one group (see the module docstring), keep the voter set
        whole when leading, and commit our membership record once per incarnation.
        Nothing waits for this; it retries."""
        me = self.membership.me
        recorded = False
        while True:
            try:
                cur = self._current
                me.raft_n = len(cur.members()) if cur is not None else 0
                me.group = self.group
                if isinstance(cur, RaftNode) and await self._yield_lone_group(cur):
                    recorded = False
                elif isinstance(cur, RaftNode):
                    if cur.status().get("role") == "leader":
                        await self._manage_voters(cur)
                    else:
                        await self._check_still_voter(cur)
                elif isinstance(cur, Learner) and self._promoting is None and \
                        self.addr in cur.voters:
                    # the group counts us as a voter (a promotion we gave up, a restart)
                    self._begin_promotion([v for v in cur.voters if v != self.addr], True)
                # (only with a leader: a 10 s wait for none held up the checks above, and
                # a voter the group had removed while it was down mounted with its old
                # state before it found out, 11 s after its start)
                if (not recorded and self._current is not None
                        and self._current.status().get("leader")):
                    await self._current.submit(
                        {"op": "member", "node": me.id, "addr": me.addr, "cap": me.capacity,
                         "tx": f"member/{me.id}/{me.incarnation}"}, timeout=10)
                    recorded = True
            except NoQuorum as e:
                log.info("raft: %s", e)
            await self._pause(1 if not recorded or self._promoting is not None else 2)

    def _shape(self) -> tuple[Any, ...]:
        """What a round of `_supervise` acts on: our member, and the members as
        membership shows them (a learner whose record now names our group, a voter
        gone)."""
        cur = self._current
        return (id(cur), len(cur.members()) if cur is not None else 0,
                self._promoting is not None, len(self.membership.suspects),
                sorted((m.id, m.state, m.raft, m.raft_n, m.group)
                       for m in self.membership.members.values()))

    async def _pause(self, period: float) -> None:
        """Until the next round: `period`, or sooner once something a round acts on
        changed (a learner that joined is promoted within SUPERVISE_POLL of the leader
        hearing of it, not up to 2 s later: a 3-node cluster formed 2-4 s sooner)."""
        shape = self._shape()
        with trio.move_on_at(next_tick(period)):
            while True:
                await sleep_ticks(SUPERVISE_POLL)
                if self._shape() != shape:
                    return

    async def _yield_lone_group(self, cur: RaftNode) -> bool:
        best = self._best_group()
        if best is None or len(cur.members()) != 1:
            return False
        if not (best.raft_n > 1 or (best.raft_n == 1 and best.group < self.group)):
            return False
        if (cur.status().get("log_entries") or 0) > LONE_GROUP_ENTRIES:
            return False
        log.info("raft: leaving our group of one to join %s's", best.id)
        with self._deliver_lock:
            self._current = self._current_tag = None
        await trio.to_thread.run_sync(cur.destroy_synchronous)
        self.voter = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.group = ""
        await self._become_learner_of(best)
        return True

    async def _manage_voters(self, raft: RaftNode) -> None:
        """As leader: one change to the voters per round (see the module docstring)."""
        voters = set(raft.members())
        members = list(self.membership.members.values())
        by_raft = {m.raft: m for m in members if m.raft}
        now = time.monotonic()
        others = sorted(voters - {self.addr})
        for addr in others:
            m = by_raft.get(addr)
            if m is not None and m.state == LEFT:
                log.info("raft: removing %s, which left the cluster", addr)
                await raft.remove_member(addr, timeout=10)
                return
        learners = sorted((m for m in members
                           if m.state == ALIVE and m.id not in self.membership.suspects
                           and m.raft and m.raft not in voters and m.raft_n >= 1
                           and m.group == self.group
                           and self._promote_failed.get(m.id, 0) < now),
                          key=lambda m: m.id)
        # Dead to membership, and silent to us: membership takes news from other members,
        # and in a partition that a member bridges, one side's news reached the other.
        # A leader removed a voter on its own side that it still heard from, and the two
        # voters left, one on each side, made no majority until the heal (the partition
        # nemesis, seed 5710); another removed a voter it heard from and, itself wiped
        # 1.5 s later, left a group that could elect no leader (seed 5709).
        dead = [a for a in others if ((m := by_raft.get(a)) is None or m.state == DEAD)
                and not raft.heard_from(a)]
        if dead and learners:
            log.info("raft: removing voter %s, which stopped answering; a learner takes its "
                     "place", dead[0])
            await self._remove_voter(raft, dead[0], by_raft.get(dead[0]))
            return
        if len(voters) > self.max_voters and others:
            suspects = [a for a in others if (m := by_raft.get(a)) is None
                        or m.id in self.membership.suspects]
            victim = (suspects or others)[-1]
            log.info("raft: %d voters, %d wanted: %s stops voting", len(voters),
                     self.max_voters, victim)
            await self._remove_voter(raft, victim, by_raft.get(victim))
            return
        if len(voters) < self.max_voters and learners:
            await self._promote_member(raft, learners[0], sorted(voters))

    async def _remove_voter(self, raft: RaftNode, addr: str, m: Member | None) -> None:
        await raft.remove_member(addr, timeout=10)
        if m is not None and m.state != LEFT:
            # (also to a member taken for dead, in the background: it may only have been
            # slow, as a voter promoted on a busy node was 1 s after its promotion, and
            # went on as a voter the group no longer counted)
            assert self._nursery is not None
            self._nursery.start_soon(self._tell_removed, m.id)

    async def _tell_removed(self, node: str) -> None:
        try:
            await self.client.call(node, {"op": "raft_demote", "group": self.group},
                                   max_data=0, timeout=5.0)
        except ObjcacheError as e:  # (it finds out by itself: `_check_still_voter`)
            log.info("raft: could not tell %s it no longer votes: %s", node, e)

    async def _promote_member(self, raft: RaftNode, m: Member, voters: list[str]) -> None:
        got = await self.client.call(m.id, {"op": "raft_promote", "voters": voters,
                                            "group": self.group}, max_data=0, timeout=10.0)
        if got is None or not got[0].get("ok"):
            self._promote_failed[m.id] = time.monotonic() + PROMOTE_RETRY
            return
        log.info("raft: adding %s (%s) to the voters", m.raft, m.id)
        try:
            await raft.add_member(m.raft, timeout=10)
        except NoQuorum:
            self._promote_failed[m.id] = time.monotonic() + 2.0
            raise

    async def _check_still_voter(self, raft: RaftNode) -> None:
        """A voter with no leader for a while asks members whether the group still counts
        it: a voter removed while it was away never hears of its removal otherwise.
        (A leader it cannot reach counts as none: pysyncobj keeps the last leader of a
        follower the group removed, which then waited for it for good; the partition
        nemesis with learners, seed 4306.)"""
        if raft.leader_reachable():
            self._leaderless_since = None
            self.without_log = None
            return
        now = time.monotonic()
        if self._leaderless_since is None:
            self._leaderless_since = now
            return
        if now - self._leaderless_since < LEADERLESS_CHECK:
            return
        self._leaderless_since = now
        voters = set(raft.members())
        # (every other voter, for the count below, and at least 3 members in all)
        others = sorted((m for m in self.membership.members.values()
                         if m.state == ALIVE and m.raft and m.raft != self.addr),
                        key=lambda m: (m.raft not in voters, m.id))
        asked = [m for m in others if m.raft in voters] or others[:3]
        without_log = [] if raft.voting else [self.addr]
        for m in asked:
            got = await self.client.call(m.id, {"op": "raft_members"}, max_data=0,
                                         timeout=2.0)
            if got is None:
                continue
            reply = got[0]
            if m.raft in voters and reply.get("without_log"):
                without_log.append(m.raft)
            members, group = reply.get("members"), reply.get("group")
            if (reply.get("leader") and isinstance(members, list) and members
                    and self.addr not in members
                    and (not group or not self.group or group == self.group)):
                await self._demote(f"{m.id} names the voters without us")
                return
        self._note_without_log(sorted(without_log), len(voters))

    def _note_without_log(self, without_log: list[str], voters: int) -> None:
        """A group that cannot elect a leader because too many of its voters came back
        without their logs (they vote only once a leader holds one): a status line and
        one log line, not a silent wait. No recovery is built for it (docs/semantics.md,
        "Durability")."""
        if voters - len(without_log) > voters // 2:
            self.without_log = None
            return
        if self.without_log != without_log:
            log.error("raft: no leader can be elected: voters %s came back without their "
                      "logs and vote only once a leader holds one; %d of %d voters hold "
                      "the log, a majority is %d", ", ".join(without_log),
                      voters - len(without_log), voters, voters // 2 + 1)
        self.without_log = without_log

    # -- leaving --------------------------------------------------------------------------

    async def leave(self) -> None:
        """Leave the group. Returns once the group no longer counts us (bounded), so that
        the next node to leave still finds a quorum."""
        self._leaving = True
        cur = self._current
        if cur is None:
            return
        me = self.membership.me
        record = {"op": "member", "node": me.id, "remove": True,
                  "tx": f"leave/{me.id}/{me.incarnation}"}
        if isinstance(cur, Learner):
            with trio.move_on_after(8):
                try:
                    await cur.submit(record, timeout=4)
                except NoQuorum as e:
                    log.warning("could not record our leaving: %s", e)
            self.close()
            return
        others = [m.addr for m in self.membership.members.values()
                  if m.state == ALIVE and m.id != me.id]
        with trio.move_on_after(12):
            try:
                await cur.submit(record, timeout=4)
                if cur.status().get("role") == "leader":
                    # pysyncobj refuses a leader's removal of itself, and waiting for a
                    # successor fails in a group of two (one member cannot elect itself):
                    # hand leadership over, then be removed as a follower.
                    await cur.step_down()
                if cur.status().get("role") != "leader":
                    voters = set(cur.members())
                    for m in sorted(self.membership.members.values(),
                                    key=lambda m: m.raft not in voters):
                        if m.state == ALIVE and m.raft in voters and await self.client.call(
                                m.id, {"op": "raft_remove", "raft": self.addr},
                                max_data=0, timeout=4.0) is not None:
                            break
            except NoQuorum as e:
                log.warning("could not leave the Raft group cleanly: %s", e)
        # Confirm the group no longer counts us (if the removal could not commit above, a
        # successor removes us after we stop), or the next node to leave would take the
        # group below a quorum of the rest.
        self.close()
        if others:
            await self._wait_removed(others)

    def close(self) -> None:
        """Stop our Raft member (its thread and sockets), without leaving the group."""
        if self._closed:
            return
        self._closed = True
        for member in (self.voter, self._promoting, self.learner):
            if member is not None:
                member.destroy()

    async def _wait_removed(self, addrs: list[str], timeout: float = 20.0) -> None:
        with trio.move_on_after(timeout):
            while True:
                for addr in addrs:
                    try:
                        reply, _ = await self.pool.request(addr, {"op": "raft_members"},
                                                           timeout=2.0)
                    except PeerError:
                        continue
                    members = reply.get("members")
                    if (isinstance(members, list) and members and self.addr not in members
                            and reply.get("voter")):
                        log.info("raft: the group removed us")
                        return
                await trio.sleep(0.3)
        log.warning("raft: the group still counted us %.0fs after we left", timeout)

    # -- serving peers and status ---------------------------------------------------------

    async def _members(self, peer: str, msg: dict[str, Any]) -> Reply:
        cur = self._current
        if cur is None:
            return {"members": [], "group": self.group}, None
        return {"members": cur.members(), "leader": cur.status().get("leader"),
                "group": self.group, "voter": isinstance(cur, RaftNode),
                "without_log": self._counted_not_voting()}, None

    async def _change(self, peer: str, msg: dict[str, Any]) -> Reply:
        addr = field_str(msg, "raft")
        try:
            split_addr(addr)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        cur = self._current
        if not isinstance(cur, RaftNode):
            raise PeerError("this member does not vote")
        if msg.get("op") == "raft_add":
            await cur.add_member(addr, timeout=25)
        else:
            await cur.remove_member(addr, timeout=25)
        return {"members": cur.members()}, None

    async def _submit(self, peer: str, msg: dict[str, Any]) -> Reply:
        """A learner's commands: commit them (batched with ours) and answer with their
        results and the index of the entry they came in."""
        cmds = msg.get("cmds")
        if not (isinstance(cmds, list) and 0 < len(cmds) <= MAX_SUBMIT_COMMANDS
                and all(isinstance(c, bytes) for c in cmds)):
            raise ProtocolError("raft_submit needs a list of packed commands")
        timeout = msg.get("timeout", 10.0)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool):
            raise ProtocolError("raft_submit's timeout is not a number")
        cur = self._current
        if not isinstance(cur, RaftNode):
            raise PeerError("this member does not vote")
        results, index = await cur.batcher.submit(cmds, min(30.0, max(0.5, timeout)))
        # The entries the learner lacks up to its command's come with the answer, so it
        # applies them at once: without them it asked its feed to hurry and waited for
        # that answer too (two more messages for every close, claim and clean).
        after = msg.get("after")
        if (isinstance(after, int) and not isinstance(after, bool)
                and msg.get("group") == self.group):
            data = cur.feed.packed_through(after, index, FEED_REPLY_BYTES)
            if data is not None:
                return {"results": results, "index": index, "data": len(data)}, data
        return {"results": results, "index": index}, None

    async def _feed(self, peer: str, msg: dict[str, Any]) -> Reply:
        """The entries after `after` (waiting up to `wait` seconds for one), or a snapshot
        of the state when they are no longer all here or the asker follows another
        group."""
        after = field_int(msg, "after", 0, 1 << 62)
        wait, linger = msg.get("wait", 0.0), msg.get("linger", 0.0)
        if not all(isinstance(v, int | float) and not isinstance(v, bool)
                   for v in (wait, linger)):
            raise ProtocolError("raft_feed's wait or linger is not a number")
        group = msg.get("group")
        snapshot = isinstance(group, str) and bool(group) and bool(self.group) \
            and group != self.group
        deadline = trio.current_time() + min(MAX_FEED_WAIT, max(0.0, wait))
        while True:
            cur = self._current
            if cur is None:
                raise PeerError("raft is not running here yet")
            if snapshot:
                return self._snapshot_reply(cur)
            self._feed_waiting = True
            # (not applied_index: "through `done`" must be a claim the feed can back)
            done = cur.fed_index()
            entries = cur.feed.since(after, FEED_REPLY_BYTES)
            if entries is None:
                return self._snapshot_reply(cur)
            if (entries or done > after) and linger > 0 and peer not in self._hurried:
                # Entries to send: wait `linger` for more, unless the learner hurries us.
                hurry = self._hurry[peer] = trio.Event()
                with trio.move_on_after(min(MAX_LINGER, linger)):
                    await hurry.wait()
                self._hurry.pop(peer, None)
                linger = 0.0
                continue
            if entries or done > after or trio.current_time() >= deadline:
                self._hurried.discard(peer)
                break
            with trio.move_on_at(deadline):
                await self._feed_event.wait()
        through = done
        if entries:
            last = entries[-1][0]
            through = last if last < cur.feed.last else max(last, done)
        data = pack_entries(entries)
        return {**self._feed_header(cur), "through": through, "data": len(data)}, data

    async def _feed_now(self, peer: str, msg: dict[str, Any]) -> Reply:
        """A learner waits for an entry: its feed request answers without lingering."""
        hurry = self._hurry.get(peer)
        if hurry is not None:
            hurry.set()
        else:  # (its request is still on its way, or was answered already)
            self._hurried.add(peer)
        return {"ok": True}, None

    def _feed_header(self, cur: RaftMember) -> dict[str, Any]:
        h = cur.feed_header()
        return {"voters": h.voters, "leader": h.leader, "group": self.group,
                "term": h.term, "commit": h.commit}

    def _snapshot_reply(self, cur: RaftMember) -> Reply:
        blob, index = cur.snapshot()
        return {**self._feed_header(cur), "snapshot": True, "through": index,
                "data": len(blob)}, blob

    def status(self) -> dict[str, Any] | None:
        cur = self._current
        if cur is None:
            return None
        st = cur.status()
        st["members"] = st["voters"] = cur.members()
        st["self"] = self.addr
        st["group"] = self.group
        st["max_voters"] = self.max_voters
        st["promotions"], st["demotions"] = self.promotions, self.demotions
        st["promoting"] = self._promoting is not None
        st["without_log"] = self.without_log
        if self._counted_not_voting():
            st["voting"] = False
        st["read_index"] = self.reads.status()
        return st
