"""A member that follows the cluster's Raft log without voting: a learner.

With every member voting, the leader sends every entry and every heartbeat to every
member, so its work per commit and at rest grows with the cluster. The cluster keeps at
most `--raft-voters` voters (5 by default: a quorum survives two failures); every other
member is a learner (objcache.cluster.raftgroup decides who is which):

- it takes the committed log from one voter, not the leader when it can: a long-poll
  `raft_feed` request answers with the entries after the index it has applied (or, when it
  is new or fell behind what the voter keeps, a snapshot of the state and its index), and
  it applies them to its own copy of the state, in order, as a voter does;
- it sends its commands to that voter (`raft_submit`); the voter commits them through the
  voters, batched with its own and other learners' (objcache.raft.node.Batcher), and
  answers with their results and the index of the entry they came in; submit returns once
  this learner has applied that index, so a command's effects are visible here when it
  returns, as on a voter (close-to-open holds on every member);
- when its voter stops answering it follows another one; the answers name the voters.

Learners spread over the voters (by a hash of their id), so the leader's cost per commit
does not depend on how many learners there are, and a voter serves about
(N - voters) / (voters - 1) learners.
"""

from __future__ import annotations

import logging
import math
import pickle
import random
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgpack
import trio

from objcache.cluster.membership import ALIVE, alive_at_raft
from objcache.errors import NoQuorum
from objcache.raft.node import (
    ANSWER_GRACE,
    STATE_REPLACED,
    Applied,
    Batcher,
    Feed,
    FeedHeader,
    StateMachine,
    apply_entry,
    pack,
)

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Member, Membership

log = logging.getLogger(__name__)

FEED_WAIT = 5.0  # a feed request waits this long for new entries before answering
# ...and, once it has some, about this long for more (jittered: see `run`), unless the
# learner waits for an entry (a read barrier, its own command): every entry woke every
# learner, and at 32 nodes on two cores the learners' answers were what the round trips
# waited behind.
LINGER = 0.2
# A learner whose node waited for an entry (a read barrier, a command of its own) this
# recently follows without lingering: its users are active, and a lookup answered from
# what it has applied needs no barrier.
ACTIVE_WINDOW = 2.0
FEED_REPLY_BYTES = 8 << 20  # entries per answer (a single bigger entry still comes whole)
MAX_FEED_DATA = 1 << 30  # what a snapshot may weigh
AVOID_SECONDS = 3.0  # a source that could not answer is not asked again this long
# A voter that did not commit our commands (no leader: cut off from it, or an election)
# is not sent commands again this long while another voter may take them.
SUBMIT_AVOID_SECONDS = 1.0
APPLY_SLICE = 64  # entries applied between two checkpoints of the event loop
LEARNER_FEED_ENTRIES = 2_000
LEARNER_FEED_BYTES = 2 << 20


class Learner:
    """Attributes:
    state: the replicated state as this learner has applied it (replaced by a snapshot).
    applied: the log index applied so far.
    voters, leader, group: as the last answer named them (Raft addresses).
    """

    def __init__(self, client: PeerClient, membership: Membership, state: StateMachine,
                 voters: list[str], group: str, on_applied: Applied,
                 wait_applied: Callable[[int, float, bool], Awaitable[None]],
                 on_progress: Callable[[int], None], applied: int = 0) -> None:
        self.client = client
        self.membership = membership
        self.state = state
        self.voters = list(voters)
        self.group = group
        self.leader: str | None = None
        self.term = 0
        self.commit = 0
        self.applied = applied  # `state` is at this index
        self.source_applied = 0
        self.source: str | None = None  # the member id we follow
        # what we applied, for a learner that asks us (one just starting, mostly)
        self.feed = Feed(max_entries=LEARNER_FEED_ENTRIES, max_bytes=LEARNER_FEED_BYTES,
                         base=applied)
        self.snapshots = 0
        self.stopped = False
        self._on_applied = on_applied
        self._wait_applied = wait_applied
        self._on_progress = on_progress
        self._avoid: dict[str, float] = {}
        self._submit_avoid: dict[str, float] = {}
        self._hash = zlib.crc32(membership.me.id.encode())
        self.batcher = Batcher(self._send_batch)
        # One change of the state at a time: entries come in feed, submit and read-index
        # answers, and their applies pause between slices. A snapshot installed in such a
        # pause set `applied` back below what the paused apply had reached, which then went
        # on from where it was: the entries in between were never applied (the partition
        # nemesis with learners, seed 5706: two files on one node left as they were
        # before their rename and unlink, which every other node showed).
        self._applying = trio.Lock()
        self._cancel = trio.CancelScope()
        self._want = 0  # the highest index someone here waits to have applied
        self._active_until = -math.inf  # (trio time) until then, no lingering
        self._lingering: str | None = None  # the source asked to linger, while it is asked

    # -- following ------------------------------------------------------------------------

    def _member(self, raft_addr: str) -> Member | None:
        return alive_at_raft(self.membership, raft_addr)

    def pick(self) -> str | None:
        """The member to follow: a voter other than the leader (its work must not grow
        with the learners), the same one while it answers, spread by our id."""
        now = time.monotonic()
        cands = sorted((m for m in (self._member(a) for a in self.voters if a != self.leader)
                        if m is not None and self._avoid.get(m.id, 0) < now),
                       key=lambda m: m.id)
        if not cands and self.leader:
            m = self._member(self.leader)
            cands = [m] if m is not None and self._avoid.get(m.id, 0) < now else []
        if not cands:  # nothing known yet: any member that follows a group may answer
            cands = sorted((m for m in list(self.membership.members.values())
                            if m.state == ALIVE and m.raft_n >= 1
                            and m.id not in self.membership.suspects
                            and self._avoid.get(m.id, 0) < now), key=lambda m: m.id)
        if not cands:
            return None
        if self.source in {m.id for m in cands}:
            return self.source
        return cands[self._hash % len(cands)].id

    async def run(self) -> None:
        """Follow the log until stopped (a promotion to voter, or the node leaving)."""
        with self._cancel:
            while not self.stopped:
                src = self.pick()
                if src is None:
                    await trio.sleep(0.2)
                    continue
                idle = (self._want <= self.applied
                        and trio.current_time() >= self._active_until)
                # Jittered: a voter answers every caught-up learner's request when the
                # next entry comes, so with one fixed linger all of them answered at the
                # same moment, and 25 learners applying at once on two cores made the
                # round trips that met them wait (close-to-open p99 at 32 nodes: 15.6-20.8
                # ms with a fixed 0.2 s, 9.8-10.2 ms jittered; docs/benchmarks.md).
                linger = LINGER * random.uniform(0.5, 1.5) if idle else 0.0
                self._lingering = src if linger else None
                try:
                    got = await self.client.call(
                        src, {"op": "raft_feed", "after": self.applied, "group": self.group,
                              "wait": FEED_WAIT, "linger": linger},
                        max_data=MAX_FEED_DATA, timeout=FEED_WAIT + LINGER + 10,
                        long_poll=True)
                finally:
                    self._lingering = None
                if self.stopped:
                    return
                if got is None:
                    self._avoid[src] = time.monotonic() + AVOID_SECONDS
                    if self.source == src:
                        self.source = None
                    await trio.sleep(0.05)
                    continue
                if self.source != src:
                    log.info("raft: following the log from %s", src)
                    self.source = src
                await self._take(got[0], got[1])

    def stop(self) -> None:
        self.stopped = True
        self._cancel.cancel()

    def active(self) -> None:
        """Someone here waited for an entry: follow without lingering for a while."""
        self._active_until = trio.current_time() + ACTIVE_WINDOW

    async def hurry(self, index: int) -> None:
        """Someone here waits until `index` is applied: the feed request on its way must
        not linger (the next one will not)."""
        if index <= max(self.applied, self._want):
            return
        self._want = index
        src = self._lingering
        if src is not None:
            await self.client.call(src, {"op": "raft_feed_now"}, max_data=0, timeout=5.0)

    async def _take(self, reply: dict[str, Any], data: Any) -> None:
        voters = reply.get("voters")
        if isinstance(voters, list) and all(isinstance(v, str) for v in voters) and voters:
            self.voters = list(voters)
        leader = reply.get("leader")
        self.leader = leader if isinstance(leader, str) else None
        term, commit = reply.get("term"), reply.get("commit")
        if isinstance(term, int) and self.leader is not None:
            # (the term of the leader we follow: a voter cut off and campaigning answered
            # with its own higher term and no leader, and learners showed that term
            # after it had been removed from the voters and the group went on in a lower
            # one: the partition nemesis with learners, seed 4305)
            self.term = term
        if isinstance(commit, int):
            self.commit = max(self.commit, commit)
        through = reply.get("through")
        if not isinstance(through, int) or data is None:
            return
        group = reply.get("group")
        if reply.get("snapshot"):
            async with self._applying:
                if (through <= self.applied
                        and (not isinstance(group, str) or group == self.group)):
                    # Older than what we applied since we asked (an answer to a command or
                    # a read barrier brought the entries): nothing to take.
                    log.info("raft: a snapshot at index %d came after we applied %d: "
                             "not taken", through, self.applied)
                    return
                state = pickle.loads(bytes(data))  # from an authenticated member
                with self.feed.lock:
                    old, self.state = self.state, state
                    self.feed.reset(through)
                    before, self.applied = self.applied, through
                if before:  # (not our first state: the node shows what came from the old)
                    self._on_applied(state, {"op": STATE_REPLACED, "old": old}, through)
                if isinstance(group, str):
                    self.group = group
                self.snapshots += 1
            log.info("raft: took a snapshot of the state at index %d (%.0f KiB)", through,
                     len(data) / 1024)
        else:
            if not await self._apply(data):
                return
            self.applied = max(self.applied, through)
        self.source_applied = through
        self._on_progress(self.applied)

    async def _apply(self, data: Any) -> bool:
        """Apply the entries packed in `data` (index, command) that follow what we have
        applied, in order; False if we stopped meanwhile. A feed answer and a submit
        answer may both bring an entry: the first applies it, the other skips it (one
        apply at a time: `_applying`)."""
        entries = msgpack.unpackb(bytes(data), raw=False)
        async with self._applying:
            for n, (idx, blob) in enumerate(entries):
                if idx <= self.applied:
                    continue
                with self.feed.lock:
                    apply_entry(self.state, blob, idx, self._on_applied)
                    self.feed.add(idx, blob)
                self.applied = idx
                self.feed.on_add()
                if n % APPLY_SLICE == APPLY_SLICE - 1:
                    self._on_progress(self.applied)
                    await trio.lowlevel.checkpoint()
                    if self.stopped:
                        return False
        return True

    # -- committing -----------------------------------------------------------------------

    async def submit(self, cmd: dict[str, Any], timeout: float = 10.0,
                     background: bool = False) -> Any:
        result, _ = await self.submit_indexed(cmd, timeout, background)
        return result

    async def submit_indexed(self, cmd: dict[str, Any], timeout: float = 10.0,
                             background: bool = False) -> tuple[Any, int]:
        """Commit `cmd` through a voter; its result once we have applied it here.
        `background`: no user here waits for it (write-back), so it does not make this
        learner follow without lingering."""
        deadline = trio.current_time() + timeout
        results, index = await self.batcher.submit([pack(cmd)], timeout)
        await self._wait_applied(index, deadline, not background)
        return results[0], index

    def _submit_target(self) -> str | None:
        """The voter to send commands to: the one we follow, unless it just failed to
        commit them and another voter may (the leader too: this is the exception); the
        one we follow all the same if every voter failed lately (an election)."""
        first = self.source or self.pick()
        now = time.monotonic()
        if first is not None and self._submit_avoid.get(first, 0) < now:
            return first
        others = sorted(m.id for m in (self._member(a) for a in self.voters)
                        if m is not None and m.id != first
                        and self._submit_avoid.get(m.id, 0) < now
                        and self._avoid.get(m.id, 0) < now)
        return others[self._hash % len(others)] if others else first

    async def _send_batch(self, blobs: list[bytes], timeout: float) -> tuple[list[Any], int]:
        target = self._submit_target()
        if target is None:
            e = NoQuorum("no voter is reachable to take commands")
            e.maybe_sent = False
            raise e
        group = self.group
        got = await self.client.call(target, {"op": "raft_submit", "cmds": blobs,
                                              "timeout": min(timeout, 30.0),
                                              "after": self.applied, "group": group},
                                     max_data=FEED_REPLY_BYTES + (1 << 20),
                                     timeout=timeout + ANSWER_GRACE + 1)
        if got is None:
            # (an error answer, "missing leader" most often: a voter cut off from the
            # leader, while this node may not be. Sent to it again and again, every
            # command and read barrier here failed for as long as that lasted.)
            self._submit_avoid[target] = time.monotonic() + SUBMIT_AVOID_SECONDS
            raise NoQuorum(f"{target} did not commit the commands")
        results, index = got[0].get("results"), got[0].get("index")
        if not isinstance(results, list) or not isinstance(index, int):
            raise NoQuorum(f"{target} answered raft_submit without results")
        # The log up to our command came with the answer (objcache.cluster.raftgroup):
        # applied here now, the submitter needs no feed answer to wait for.
        if got[1] is not None:
            await self.take(got[1], index, group)
        return results, index

    async def take(self, data: Any, index: int, group: str) -> None:
        """Apply entries that came with an answer (a submit's, a read index's) to a
        request made in `group`, up to at least `index`, as if the feed had brought them;
        nothing if we follow another group by now."""
        if group == self.group and index > self.applied and await self._apply(data):
            self._on_progress(self.applied)

    def applied_index(self) -> int:
        return self.applied

    def fed_index(self) -> int:
        """The index through which the feed holds every command applied here."""
        return self.applied

    def snapshot(self) -> tuple[bytes, int]:
        with self.feed.lock:
            return pickle.dumps(self.state, protocol=pickle.HIGHEST_PROTOCOL), self.applied

    # -- reporting ------------------------------------------------------------------------

    def members(self) -> list[str]:
        return sorted(self.voters)

    def feed_header(self) -> FeedHeader:
        return FeedHeader(self.members(), self.leader, self.term, self.commit)

    def status(self) -> dict[str, Any]:
        source = self.membership.members.get(self.source or "")
        return {"role": "learner", "voter": False, "term": self.term,
                "commit_index": self.commit, "last_applied": self.applied,
                "apply_lag": max(0, self.source_applied - self.applied),
                "leader": self.leader, "partners": None, "log_entries": None,
                "commands": getattr(self.state, "applied", None),
                "batches": self.batcher.batches, "batched_commands": self.batcher.commands,
                "source": source.raft if source is not None else None,
                # The voters membership finds alive (a learner keeps no connection to
                # them: this is what `objcache status` judges a cut-off by)
                "connected": sorted(a for a in self.voters if self._member(a) is not None),
                "snapshots": self.snapshots, "thread_cpu_seconds": None}

    def destroy(self) -> None:
        self.stop()
