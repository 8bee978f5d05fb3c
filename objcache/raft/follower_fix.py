"""Corrections to pysyncobj 0.3.17's Raft follower, as a mixin of the SyncObj subclass.

Upstream behaviour replaced, and why (both reproduced by tests/integration/test_raft.py,
a leader killed with kill -9 under load; unit tests in tests/unit/test_raft_follower_fix.py
feed a non-ticking member crafted messages):

1. `__onMessageReceived` (append_entries): pysyncobj deletes every entry after prevLogIdx
   whenever it holds more than the message covers, even entries it already applied
   ("truncating already-applied log entries ... may have diverged"). With pipelined
   appends and resends after a leader change that is most messages. Raft (section 5.3)
   deletes only entries that conflict. Here each message first loses the leading entries
   we already hold (same index and term); if nothing new is left, our log is left alone,
   and we acknowledge only what is verified (the message's end, or our whole log when its
   tail is the sender's own term: a leader never rewrites its own term), with the commit
   index capped to that point so an unverified tail is never applied.
2. `__sendNextNodeIdx` (the rejection): rejecting a message whose prevLogIdx is beyond its
   log, pysyncobj asks for "my last index + 1" even when that tail is another term's and
   conflicts; rejecting a mismatch it asks for prevLogIdx. The leader pipelines several
   messages per tick, so the two answers alternate forever and a restarted old leader
   never catches up (seen as clients stalled for minutes). A rejection here asks for our
   commit index + 1 when our tail is not the leader's term: committed entries never
   conflict, and resent entries are trimmed as in 1.

3. Votes of a member without a log (`joining`): Raft's safety assumes a voter never
   forgets its log. A node whose cache disk was wiped comes back at its old address, and
   the group still counts that address as a voter; with an empty log it would grant its
   vote to any candidate, so a stale candidate plus the wiped node made a majority
   without entries committed before the wipe, and the new leader erased them (the
   partition nemesis, seed 1101: acknowledged files lost). A member that joins with no
   log neither votes nor stands for election until it holds an entry that the leader
   committed in its own term: then every committed entry is in its log, as in any voter's
   (Raft thesis 4.2.1 adds servers as non-voting until caught up for the same reason).
   A member whose address the group already counts as a voter (`wiped`: its cache dir
   was lost) acknowledges nothing either while joining (a success is sent as a reset that
   moves the leader's next index but never counts toward a commit, and the leader forgets
   what our previous incarnation acknowledged), and "caught up" needs a commit made after
   we first heard from the leader in its term: made without us, so by a majority of the
   other voters in that term, none of which has seen a later term. A leader left over
   from an older term (frozen while the others elected a successor, not yet stepped
   down) committed its entries before; with our acknowledgements it committed new ones
   against the successor's log, which later replaced entries already applied
   (test_voter_back_without_its_log_cannot_elect_a_stale_node: k0 lost on two nodes).
   A new member (not yet a voter) acknowledges as before: the group's majority without
   it already rejects a stale leader, and a group of one could not grow otherwise.

4. Promises (Raft thesis 6.4.1, the lease; objcache/cluster/readindex.py): a voter that
   answers the leader's `raft_term` question with a promise neither grants a vote nor
   stands for election until the promise ends. A leader that holds promises from a
   majority (itself included) knows that no other leader can be elected before the first
   of them ends, and answers read barriers from its own commit index meanwhile, without a
   round among the voters for each. pysyncobj grants a vote to any candidate with a
   later term and a log as long, even while it hears from a leader. (The candidate's
   term still becomes ours, unlike the thesis's rule, which pairs it with a pre-vote
   pysyncobj does not have: see `_SyncObj__onMessageReceived`.) A promise is made on
   the trio thread and kept on pysyncobj's: `kept` calls back once the tick in progress
   has ended (each tick checks the promise before it may start an election, and a vote
   is only granted within a tick), so an election or a vote that came before the promise
   has moved our term by then, and the answer names that term. A member restarted from
   its journal may have promised before: it keeps MAX_PROMISE from its start.
   A leader that hands over because it leaves the group (`leaving`) stands for no
   election after: a drained leader stood again while its successor's election failed,
   won the next term and left, and commits waited for a third election.

5. Snapshots: a leader sends its dump in parts of 64 KiB and a last, empty one, each an
   append_entries with the leader's commit index. For every part but the last,
   pysyncobj then sets our commit index to the smaller of the leader's and our log's end,
   without checking that our log matches the leader's at all: a deposed leader, back
   from a partition with entries of its own term that were never committed, applied them
   (and answered their submitters "done") while the leader's dump arrived. Seeds 5911 and
   5949 of the partition nemesis: a write-back claim that the majority never committed
   answered "ok", and its upload put back an object the log had renamed away. A part of
   a snapshot here carries no commit index beyond ours; the loaded dump then counts as
   committed (it holds only what the leader applied).

Chunked ("transmission") messages go to pysyncobj unchanged; objcache keeps commands out
of that path (appendEntriesBatchSizeBytes, objcache/raft/node.py).
The names below are pysyncobj's private (name-mangled) methods: the pin on
pysyncobj==0.3.17 in pyproject.toml is what makes overriding them safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.monotonic import monotonic

log = logging.getLogger(__name__)

MAX_PROMISE = 1.0  # 4.: the longest promise a voter makes (seconds)
FOLLOWER = 0  # pysyncobj's _RAFT_STATE.FOLLOWER


class FollowerFix:
    """Mix in before SyncObj: `class Replica(FollowerFix, SyncObj)`."""

    _ack_limit: int | None = None  # see _follow
    # 3.: set before SyncObj.__init__ (never part of a dump); cleared once caught up
    joining: bool = False
    leaving: bool = False  # 4.: handing over to leave the group: no candidacy from now on
    wiped: bool = False  # 3.: the group counts our address as a voter already
    # 3.: (term, the leader's commit index) from the first append_entries of that term
    _join_base: tuple[int, int] | None = None
    # 4.: (monotonic) no vote nor candidacy before this; set before SyncObj.__init__
    promise_until: float = 0.0
    _ticked: list[Callable[[], None]]  # 4.: called after the tick in progress
    # (monotonic) when the leader we follow last sent us an append_entries: RaftNode takes
    # one silent for LEADER_SILENT as unreachable
    heard_leader_at: float = 0.0
    _ticked_lock: threading.Lock

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> Any:
        self._ack_limit = None
        kind = message.get("type") if isinstance(message, dict) else None
        if self.joining and kind == "request_vote":
            return None  # no vote while our log may lack committed entries
        if kind == "request_vote" and monotonic() < self.promise_until:
            # 4.: no vote while we promised. A later term is ours all the same, as
            # pysyncobj takes it (a leader steps down): a member cut off campaigns in terms
            # the group never had, then refuses the appends of the leader's lower term, and
            # only its vote requests tell the others. Kept out, it never came back while
            # the leader renewed its lease (the partition nemesis, seed 5005: 18-33 s).
            if message["term"] > self._SyncObj__raftCurrentTerm:  # type: ignore[attr-defined]
                log.info("raft: no vote for %s in term %d: promised for %.2fs more",
                         getattr(node, "id", node), message["term"],
                         self.promise_until - monotonic())
                self._SyncObj__setCurrentTerm(message["term"], None)  # type: ignore
                self._SyncObj__setState(FOLLOWER)  # type: ignore[attr-defined]
                self._SyncObj__raftLeader = None
            return None
        if self.joining and self.wiped and kind == "append_entries":
            term = message["term"]
            if (term >= self._SyncObj__raftCurrentTerm  # type: ignore[attr-defined]
                    and (self._join_base is None or self._join_base[0] != term)):
                self._join_base = (term, message["commit_index"])
        if kind == "next_node_idx" and message.get("joining"):
            # a member without a log: nothing its previous incarnation acknowledged counts
            match = self._SyncObj__raftMatchIndex  # type: ignore[attr-defined]
            if node in match:
                match[node] = 0
        if (kind == "append_entries" and "prevLogIdx" in message
                and message.get("transmission") is None):
            message = self._follow(message)
        elif kind == "append_entries" and message.get("serialized") is not None:
            # 5.: a part of a snapshot commits nothing of our log (the dump, once whole,
            # counts as committed: `_SyncObj__loadDumpFile`)
            message = dict(message, commit_index=min(
                message["commit_index"], self._SyncObj__raftCommitIndex))  # type: ignore
        try:
            return SyncObj._SyncObj__onMessageReceived(self, node, message)  # type: ignore
        finally:
            self._ack_limit = None
            if kind == "append_entries" and self._SyncObj__raftLeader is node:  # type: ignore
                self.heard_leader_at = monotonic()
            if self.joining and kind == "append_entries":
                self._check_caught_up()

    def _check_caught_up(self) -> None:
        """Vote again once our commit index holds an entry of the leader's term (a leader
        commits an entry of its own term only with every earlier one); `wiped`: one it
        committed after we first heard from it, so without our acknowledgement, by a
        majority of the other voters, none of which had seen a later term."""
        commit = self._SyncObj__raftCommitIndex  # type: ignore[attr-defined]
        term = self._SyncObj__raftCurrentTerm  # type: ignore[attr-defined]
        base = self._join_base
        if self.wiped and (base is None or base[0] != term or commit <= base[1]):
            return
        got = self._SyncObj__getEntries(commit, 1)  # type: ignore[attr-defined]
        if got and got[0][2] == term:
            self.joining = False
            self._SyncObj__raftElectionDeadline = (  # type: ignore[attr-defined]
                monotonic() + self._SyncObj__generateRaftTimeout())  # type: ignore
            log.info("raft: caught up with the leader's log (index %d, term %d); voting "
                     "from now on", commit, got[0][2])
            self.on_caught_up()

    def on_caught_up(self) -> None:
        """Called on pysyncobj's thread once `joining` is cleared."""

    def _onTick(self, timeToWait: float = 0.0) -> Any:
        if self.joining or self.leaving:  # no candidacy: push the election deadline on
            self._SyncObj__raftElectionDeadline = monotonic() + 3600  # type: ignore
        elif monotonic() < self.promise_until:  # 4.: nor while we promised
            self._SyncObj__raftElectionDeadline = max(  # type: ignore[attr-defined]
                self._SyncObj__raftElectionDeadline, self.promise_until)  # type: ignore
        try:
            return SyncObj._onTick(self, timeToWait)  # type: ignore[misc]
        finally:
            with self._ticked_lock:
                done, self._ticked = self._ticked, []
            for call in done:
                call()

    def promise(self, seconds: float, kept: Callable[[], None]) -> None:
        """4.: no vote nor candidacy for `seconds` (at most MAX_PROMISE) from now; `kept`
        is called on pysyncobj's thread once the tick in progress has ended."""
        self.promise_until = max(self.promise_until,
                                 monotonic() + min(max(seconds, 0.0), MAX_PROMISE))
        with self._ticked_lock:
            self._ticked.append(kept)
        notifier = getattr(self, "_SyncObj__pipeNotifier", None)
        if notifier is not None:  # (a tick now, not at the next poll's timeout)
            notifier.notify()

    def release(self) -> None:
        """4.: end our promise (a leader that hands over: the successor needs our vote;
        the other voters' promises still hold until they end)."""
        self.promise_until = 0.0

    def _follow(self, message: dict[str, Any]) -> dict[str, Any]:
        get = self._SyncObj__getEntries  # type: ignore[attr-defined]
        prev = get(message["prevLogIdx"], 1)
        if not prev or prev[0][2] != message["prevLogTerm"]:
            return message  # rejected by pysyncobj; the answer is fixed in __sendNextNodeIdx
        entries = message.get("entries") or []
        known = 0
        for _, idx, term in entries:
            mine = get(idx, 1)
            if not mine or mine[0][2] != term:
                break
            known += 1
        if known < len(entries):
            if known == 0:
                return message
            _, last_idx, last_term = entries[known - 1]
            return dict(message, entries=entries[known:], prevLogIdx=last_idx,
                        prevLogTerm=last_term)
        verified = entries[-1][1] if entries else message["prevLogIdx"]
        _, my_last, my_term = self._SyncObj__raftLog[-1]  # type: ignore[attr-defined]
        if my_last == verified or my_term == message["term"]:
            return dict(message, entries=[], prevLogIdx=my_last, prevLogTerm=my_term)
        # Our tail is another term's: keep it (it may be committed), but neither
        # acknowledge nor commit past what this message verified.
        self._ack_limit = verified + 1
        return dict(message, entries=[], prevLogIdx=my_last, prevLogTerm=my_term,
                    commit_index=min(message["commit_index"], verified))

    def _SyncObj__sendNextNodeIdx(self, node: Any, reset: bool = False,
                                  nextNodeIdx: int | None = None,
                                  success: bool = False) -> Any:
        if success and self._ack_limit is not None:
            nextNodeIdx = self._ack_limit
        elif reset and not success:
            _, my_last, my_term = self._SyncObj__raftLog[-1]  # type: ignore[attr-defined]
            if my_term != self._SyncObj__raftCurrentTerm:  # type: ignore[attr-defined]
                asked = my_last + 1 if nextNodeIdx is None else nextNodeIdx
                nextNodeIdx = min(asked, self._SyncObj__raftCommitIndex + 1)  # type: ignore
        if self.joining and self.wiped:  # 3.: moves the next index, never counts for a commit
            if nextNodeIdx is None:
                nextNodeIdx = self._SyncObj__getCurrentLogIndex() + 1  # type: ignore
            self._SyncObj__transport.send(node, {  # type: ignore[attr-defined]
                "type": "next_node_idx", "next_node_idx": nextNodeIdx,
                "reset": reset or success, "success": False, "joining": True})
            return None
        return SyncObj._SyncObj__sendNextNodeIdx(self, node, reset=reset,  # type: ignore
                                                 nextNodeIdx=nextNodeIdx, success=success)
