"""A Raft member (pysyncobj) replicating a deterministic state machine, with a trio-facing
`submit`; group commit (`Batcher`); and the `Feed` of applied entries that the members
which follow the log without voting read (objcache.cluster.learner).

The raft layer knows no objcache state: a member replicates whatever `StateMachine` it is
given (objcache.txn.state.ClusterState in a daemon, a counter machine in the stress test).
pysyncobj runs its own thread (autoTick); a submitted command's result comes back through
a callback on that thread and is handed to the trio task waiting for it with the trio
token (run_sync_soon is thread-safe). A command that cannot commit within its timeout (no
quorum, no leader) raises NoQuorum: callers turn that into EIO after a bounded wait.

Commands submitted while earlier ones are on their way to the log go together in one log
entry (a msgpack array of packed commands, applied in order by `apply_entry`): one round
of messages to the voters and one journal write for many commands. Results must be
msgpack-able (a learner gets them over the peer protocol).

The configuration is chosen from what was measured on these machines (see
docs/architecture.md, "Raft"):
- no password: pysyncobj pickles messages on the wire, so every frame must be
  authenticated with the cluster secret, but pysyncobj's password mode also encrypts
  them (Fernet); the frames are sealed instead (objcache.raft.guard.FrameSeal, given to
  pysyncobj as its encryptor);
- commands are msgpack bytes, so what is pickled is only bytes;
- useFork=False: forking a multi-threaded daemon for log compaction is unsafe;
- appendEntriesUseBatch=False: the batch period would add ~100 ms to every commit;
- a journal file and a full dump file in the node's own directory, so a restarted node
  replays its log;
- log compaction after COMPACT_ENTRIES entries or 10 minutes: a voter holds its log in
  memory, and the dump that compacts it stops the Raft thread while it is written (the
  state keeps that short: objcache.txn.state).
The follower's log handling is corrected in objcache/raft/follower_fix.py, and the port is
defended (own address only, authentication deadline, frame limits) in
objcache/raft/guard.py.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
import trio
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.journal import FileJournal
from pysyncobj.monotonic import monotonic

from objcache.errors import NoQuorum
from objcache.raft.follower_fix import FOLLOWER, MAX_PROMISE, FollowerFix
from objcache.raft.guard import FrameSeal, GuardedTransport

log = logging.getLogger(__name__)

ROLES = {0: "follower", 1: "candidate", 2: "leader"}
LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER
# The command handed to `on_applied` (with "old": the state before) when a snapshot
# replaced a member's state: what changed is every difference between the two.
STATE_REPLACED = "raft.state_replaced"
STOP_POLL = 0.25  # seconds between looks, while a call waits, at whether we were stopped
JOINING_MARK = "joining"  # in the data dir while a member without the whole log joins
# ...saying which: a member the group counted before it lost its log (`wiped`), or one
# promoted with an empty journal, which has lost nothing it acknowledged
MARK_WIPED, MARK_JOINING = b"wiped", b"joining"


class StateMachine(Protocol):
    """What a member replicates: `apply` must be deterministic (same commands, same
    results and state everywhere) and the object picklable (snapshots)."""

    def apply(self, cmd: dict[str, Any]) -> Any: ...


# Called after each applied command (on pysyncobj's thread in a voter): the machine, the
# command, the index of the log entry it came in (a batch's commands share one).
Applied = Callable[[Any, dict[str, Any], int], None]

# Entries a voter keeps for the learners that follow it; one further behind takes a
# snapshot. Bounded in bytes too: it is resident memory.
FEED_ENTRIES = 20_000
FEED_BYTES = 16 << 20
# A voter compacts its log (a dump of the state, then the entries before it dropped) once
# it holds this many (pysyncobj's default is 5,000). The log is in memory, about
# 0.5 KB an entry (3 voters after 22,000 entries in 60 s: 126 MB against 136 with
# the 200,000 set before), so it could grow by 100 MB in the 10 minutes of COMPACT_SECONDS.
# A follower further behind than the log takes the dump instead, a few MB.
COMPACT_ENTRIES = 10_000
COMPACT_SECONDS = 600
DUMP_LOGGED = 0.02  # a compaction that held the Raft thread this long is logged
BATCH_BYTES = 4 << 20  # one log entry carries at most this much of a batch...
BATCH_COMMANDS = 256  # ...and this many commands
BATCHES_IN_FLIGHT = 2
# A batch waits this long at most for a leader (about an election: pysyncobj's timeouts
# are 0.4-1.4 s), then fails, and its commands are sent again by their submitters: a
# learner's, through another voter. A voter cut off from the leader by a bridged
# partition held a learner's close for its whole 5 s, while the other voters, which the
# learner reached, committed (partition seed 5926: EIO with every node reachable).
LEADERLESS_BATCH = 2.0
ANSWER_GRACE = 2.0  # a command sent to a leader gets this long past its timeout to answer
# A follower that has heard nothing from its leader for this long (pysyncobj's longest
# election timeout) has none it can reach: pysyncobj keeps the last leader of a member
# connected to nobody, and links whose packets are dropped look connected for
# connectionTimeout (3.5 s). Nor can a leader that heard from no majority for this long
# commit (it steps down at leaderFallbackTimeout, 3.5 s).
LEADER_SILENT = 1.4
PROMISE_WAIT = 0.5  # pysyncobj's thread ends its tick within this after a promise, or no
PROMISE_SLACK = 0.05  # a voter's promise began after ours by a question's flight, about
TRANSFER_TRIES = 1.0  # a leaving leader asks a follower to take over for this long...
TRANSFER_RETRY = 0.01  # ...this often


def make_conf(data_dir: Path, bind: str | None = None,
              compact_entries: int = COMPACT_ENTRIES) -> SyncObjConf:
    return SyncObjConf(
        bindAddress=bind,  # our own address: pysyncobj would bind 0.0.0.0
        useFork=False,
        appendEntriesUseBatch=False,
        journalFile=str(data_dir / "raft.journal"),
        fullDumpFile=str(data_dir / "raft.dump"),
        dynamicMembershipChange=True,
        # Without a leader a command fails at once (MISSING_LEADER) and `_call` tries it
        # again until its timeout. pysyncobj's own wait keeps the command in its queue
        # with no deadline: a close that had answered EIO was sent when the network
        # healed, and took effect (the partition nemesis).
        commandsWaitLeader=False,
        autoTick=True,
        raftMinTimeout=0.4,
        raftMaxTimeout=1.4,
        connectionTimeout=3.5,
        # Of two members, the one with the higher address connects; it tries again this
        # often (pysyncobj: 5 s). A member restarted at a lower address (a wiped voter
        # catching up, a killed leader's successor) waited up to 5 s to hear from the
        # group: 3.4-4.3 s per wiped voter in test_txn's rolling restart.
        connectionRetryTime=1.0,
        # A leader that has heard from no majority for this long steps down (pysyncobj's
        # default is 30 s): a leader cut off from the majority stops taking commands
        # (which could only be settled after the heal, as in doubt) within seconds.
        leaderFallbackTimeout=3.5,
        logCompactionMinEntries=compact_entries,
        logCompactionMinTime=COMPACT_SECONDS,
        # one command up to this size travels as one message; bigger ones would take
        # pysyncobj's chunked path, which the follower fix does not cover
        appendEntriesBatchSizeBytes=16 << 20,
    )


def _ignore(machine: Any, cmd: dict[str, Any], index: int) -> None:
    pass


def pack(cmd: dict[str, Any]) -> bytes:
    return msgpack.packb(cmd, use_bin_type=True)


def apply_entry(state: StateMachine, blob: bytes, index: int, on_applied: Applied) -> Any:
    """Apply one log entry to `state`: a msgpack map is one command, an array of commands
    (each its own msgpack bytes) is a batch whose results come back as a list, in order.
    Deterministic: the same bytes fail the same way on every member."""
    try:
        entry = msgpack.unpackb(blob, raw=False)
    except Exception as e:
        return {"error": f"undecodable command: {e}"}
    if isinstance(entry, list):
        results = []
        for one in entry:
            try:
                cmd = msgpack.unpackb(one, raw=False) if isinstance(one, bytes) else None
            except Exception as e:
                results.append({"error": f"undecodable command: {e}"})
                continue
            results.append(_apply_one(state, cmd, index, on_applied))
        return results
    return _apply_one(state, entry, index, on_applied)


def _apply_one(state: StateMachine, cmd: Any, index: int, on_applied: Applied) -> Any:
    if not isinstance(cmd, dict):
        return {"error": "a command must be a map"}
    result = state.apply(cmd)
    try:
        on_applied(state, cmd, index)
    except Exception:  # our caches are not the replicated state: never stop Raft
        log.exception("handing an applied command to this node's caches failed")
    return result


class Feed:
    """The log entries this member applied lately, for the members that follow the log
    without voting (objcache.cluster.learner). Written on the thread that applies, read
    from trio; `lock` also makes a snapshot of the state consistent with an index.

    Every command entry with an index above `base` is held (other entries, pysyncobj's
    no-ops and membership changes, change no state); older ones are dropped once the
    feed holds more than `max_entries` or `max_bytes`. `base` starts at the index of the
    state the entries follow (`reset`): a member that starts from a state at index 40,
    asked for what follows 30, answers with a snapshot. (With `base` at 0 it answered "no
    entries, applied through 40", and the asker skipped 31-40 for good: a demoted voter
    followed by two learners, the partition nemesis with learners, seed 4406.)
    """

    def __init__(self, max_entries: int = FEED_ENTRIES, max_bytes: int = FEED_BYTES,
                 base: int = 0) -> None:
        self.lock = threading.Lock()
        self.entries: deque[tuple[int, bytes]] = deque()
        self.bytes = 0
        self.base = base
        self.last = 0  # index of the last entry added (0: none yet)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.on_add: Callable[[], None] = _nothing

    def add(self, index: int, blob: bytes) -> None:
        """Under `lock`, right after the entry was applied to the state."""
        if self.last == 0:
            # what came before was in the state we started from
            self.base = max(self.base, index - 1)
        self.entries.append((index, blob))
        self.bytes += len(blob)
        self.last = index
        while self.entries and (len(self.entries) > self.max_entries
                                or self.bytes > self.max_bytes):
            idx, old = self.entries.popleft()
            self.bytes -= len(old)
            self.base = idx

    def reset(self, base: int) -> None:
        """The state was replaced by one at index `base` (a snapshot was loaded): nothing
        held follows from it."""
        self.entries.clear()
        self.bytes = 0
        self.last = 0
        self.base = base

    def since(self, after: int, max_bytes: int) -> list[tuple[int, bytes]] | None:
        """Entries after index `after`, at least one and about `max_bytes` at most; None
        if some of them are no longer held (the follower needs a snapshot)."""
        with self.lock:
            if after < self.base:
                return None
            out: list[tuple[int, bytes]] = []
            size = 0
            # Indexes rise by one or more per entry, so at most `last - after` entries
            # follow `after`: start looking there.
            start = max(0, len(self.entries) - max(0, self.last - after))
            for i in range(start, len(self.entries)):
                idx, blob = self.entries[i]
                if idx <= after:
                    continue
                if out and size + len(blob) > max_bytes:
                    break
                out.append((idx, blob))
                size += len(blob)
            return out

    def packed_through(self, after: int, index: int, max_bytes: int) -> bytes | None:
        """The entries after `after` up to at least `index`, packed as an answer carries
        them (`pack_entries`); None if they are not all held or are more than
        `max_bytes` (the asker's feed brings them instead)."""
        if not 0 <= after < index:
            return None
        entries = self.since(after, max_bytes)
        if not entries or not entries[0][0] <= index <= entries[-1][0]:
            return None
        return pack_entries(entries)


def pack_entries(entries: list[tuple[int, bytes]]) -> bytes:
    """Log entries (index, command) as a feed answer, a submit answer or a read index
    carries them (objcache.cluster.learner's `take` reads them)."""
    return msgpack.packb([[i, b] for i, b in entries], use_bin_type=True)


@dataclass(frozen=True)
class FeedHeader:
    """The group as a member that feeds learners sees it (objcache.cluster.learner)."""

    voters: list[str]
    leader: str | None
    term: int
    commit: int


def _nothing() -> None:
    pass


class _Replica(FollowerFix, SyncObj):  # type: ignore[misc]
    def __init__(self, self_addr: str, partners: list[str], conf: SyncObjConf, secret: str,
                 state: StateMachine, on_applied: Applied = _ignore,
                 joining: bool = False, wiped: bool = False,
                 joining_mark: Path | None = None) -> None:
        self.state = state
        self.on_applied = on_applied  # set before __init__: never dumped
        # The last index `_apply` applied. pysyncobj answers a command (its callback)
        # before it counts the entry applied (raftLastApplied), so a caller woken by the
        # answer could read an applied index one short of its own command.
        self.applied_through = 0
        self.feed = Feed()
        self._fed_state = state
        self.joining = joining  # see FollowerFix: no vote until caught up
        self.wiped = wiped  # see FollowerFix: nor an acknowledgement
        self.joining_mark = joining_mark  # removed once caught up (RaftNode)
        self._seal = FrameSeal(secret)
        self._ticked, self._ticked_lock = [], threading.Lock()  # FollowerFix's promises
        if conf.journalFile and os.path.exists(conf.journalFile):
            # restarted: we may have promised before (FollowerFix, 4.), and kept no record
            self.promise_until = monotonic() + MAX_PROMISE
        super().__init__(self_addr, partners, conf=conf, transportClass=GuardedTransport)
        # pysyncobj dumps (log compaction, a snapshot sent to a new follower) only hold
        # attributes set after its __init__: the state must be one of them.
        self._SyncObj__properies.discard("state")

    def on_caught_up(self) -> None:
        if self.joining_mark is not None:
            self.joining_mark.unlink(missing_ok=True)

    @property
    def encryptor(self) -> FrameSeal:  # what pysyncobj's transport seals frames with
        return self._seal

    # -- the journal under a dump -------------------------------------------------------
    #
    # pysyncobj keeps its journal only when it starts with the two entries a dump ends
    # with, and otherwise empties it for the dump's two, losing every entry after them.
    # Two ways that lost entries this member had acknowledged (the Raft stress test,
    # kill -9 with a compaction every 150 entries: "raftCommitIndex (743) exceeds journal
    # end (739) after loading dump"):
    # - a compaction replaces the dump, then on a later tick drops the journal's entries
    #   it covers, by emptying the journal file and writing the rest back one by one: a
    #   member killed between the two, or during the second, came back with a journal that
    #   did not start at the dump's end, or held only the start of the rest;
    # - a snapshot from the leader that ends inside this member's log (a restarted member
    #   the leader took to be further behind) replaced the whole log, where Raft keeps the
    #   entries that follow the snapshot when the log holds its last entry.
    # Here the rest of a compacted journal goes to a new file that replaces the journal
    # at once, and a journal that holds a dump's last two entries past its start is cut to
    # start at them, so pysyncobj keeps what follows.

    def _SyncObj__deleteEntriesTo(self, to_index: int) -> None:
        log_ = self._SyncObj__raftLog  # type: ignore[attr-defined]
        path = self._SyncObj__conf.journalFile  # type: ignore[attr-defined]
        if not isinstance(log_, FileJournal) or not path or not len(log_):
            SyncObj._SyncObj__deleteEntriesTo(self, to_index)  # type: ignore[attr-defined]
            return
        skip = to_index - log_[0][1]
        if skip <= 0:
            return
        rest = [log_[i] for i in range(skip, len(log_))]
        tmp = f"{path}.compacting"
        for stale in (tmp, f"{tmp}.meta"):
            if os.path.exists(stale):
                os.unlink(stale)
        new = FileJournal(tmp)
        for entry in rest:
            new.add(*entry)
        new.flush()
        new._destroy()  # (closes it; nothing is deleted)
        log_.onOneSecondTimer()  # its commit index, if not stored yet
        log_._destroy()
        os.replace(tmp, path)
        self._SyncObj__raftLog = FileJournal(path)  # type: ignore[attr-defined]

    def majority_heard(self, within: float) -> bool:
        """(Any thread; leading) Whether a majority of the voters, ourselves included,
        answered us within the last `within` seconds (pysyncobj's own count, which steps
        a leader down after leaderFallbackTimeout)."""
        heard = self._SyncObj__lastResponseTime  # type: ignore[attr-defined]
        try:
            others = list(self._SyncObj__otherNodes)  # type: ignore[attr-defined]
        except RuntimeError:  # (changed while we copied it: a membership change)
            return True
        since = monotonic() - within
        return 1 + sum(1 for n in others if heard.get(n, 0.0) > since) > (len(others) + 1) / 2

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:
        if self._journal_from_dump_end(clearJournal):
            clearJournal = False  # (a snapshot: the entries after it are kept)
        SyncObj._SyncObj__loadDumpFile(self, clearJournal)  # type: ignore[attr-defined]
        # A dump holds only applied, so committed, entries: the commit index is at least
        # its end (a leader's snapshot no longer raises it part by part: FollowerFix, 5.)
        applied = self._SyncObj__raftLastApplied  # type: ignore[attr-defined]
        if self._SyncObj__raftCommitIndex < applied:  # type: ignore[attr-defined]
            self._SyncObj__raftCommitIndex = applied
            self._SyncObj__raftLog.setRaftCommitIndex(applied)  # type: ignore[attr-defined]
        # Our commands in entries the dump covers are never applied here one by one, so
        # pysyncobj never answers them: a leader cut off from its peers, sent the new
        # leader's dump at the heal, held a write-back claim until its 5 s timeout, and
        # a flush begun after the heal failed for it (partition seed 5963). Whether each
        # was committed the dump does not say: answered now as the leader having changed,
        # which callers take as "maybe in the log" and settle, as after the timeout.
        waiting = self._SyncObj__commandsWaitingCommit  # type: ignore[attr-defined]
        for idx in [i for i in waiting if i <= applied]:
            for _, callback in waiting.pop(idx):
                callback(None, FAIL_REASON.LEADER_CHANGED)

    def _journal_from_dump_end(self, snapshot: bool) -> bool:
        """Whether the journal holds the two entries the dump ends with; cut to start at
        them when they are past its start. `snapshot`: the dump is the leader's, just
        received (else ours, on a restart)."""
        log_ = self._SyncObj__raftLog  # type: ignore[attr-defined]
        try:
            data = self._SyncObj__serializer.deserialize()  # type: ignore[attr-defined]
            before_last, last = tuple(data[2]), tuple(data[1])
        except Exception:  # (pysyncobj's own load reports a dump it cannot read)
            return False
        if len(log_) < 2:
            return False
        at = before_last[1] - log_[0][1]
        if not (0 <= at < len(log_) - 1 and tuple(log_[at]) == before_last
                and tuple(log_[at + 1]) == last):
            return False
        committed = self._SyncObj__raftCommitIndex  # type: ignore[attr-defined]
        if snapshot and committed <= last[1]:
            return False  # nothing after it is known to be the leader's
        if at or snapshot:
            log.info("raft: %s ends at index %d, inside our log (%d-%d): the entries after "
                     "it are kept%s", "the leader's snapshot" if snapshot else "our dump",
                     last[1], log_[0][1], log_[len(log_) - 1][1],
                     f" through the commit index {committed}" if snapshot else "")
        if at:
            self._SyncObj__deleteEntriesTo(before_last[1])
        if snapshot:
            # We then tell the leader our log's end as the index it matches from: only
            # committed entries are sure to be its own (those after may be a deposed
            # leader's, never committed).
            SyncObj._SyncObj__deleteEntriesFrom(self, committed + 1)  # type: ignore[attr-defined]
        return True

    def _SyncObj__tryLogCompaction(self) -> None:
        """pysyncobj's, timed: the dump it writes (useFork=False) holds this thread, so
        no entry is sent or committed meanwhile, and an operator should see how long."""
        entries = len(self._SyncObj__raftLog)  # type: ignore[attr-defined]
        began = monotonic()
        SyncObj._SyncObj__tryLogCompaction(self)  # type: ignore[attr-defined]
        took = monotonic() - began
        if took >= DUMP_LOGGED:
            log.info("raft: dumped the state to compact a log of %d entries in %.0f ms",
                     entries, took * 1e3)

    @replicated  # type: ignore[misc]
    def _apply(self, blob: bytes) -> Any:
        # pysyncobj counts an entry as applied once this returns: this is the next one
        index = self._SyncObj__raftLastApplied + 1
        with self.feed.lock:
            if self.state is not self._fed_state:  # a snapshot replaced the state
                log.info("raft: the state now comes from a dump through index %d (ours "
                         "after a restart, or the leader's: we were behind its log)",
                         index - 1)
                self.feed.reset(index - 1)
                self.on_applied(self.state, {"op": STATE_REPLACED, "old": self._fed_state},
                                index - 1)
                self._fed_state = self.state
            result = apply_entry(self.state, blob, index, self.on_applied)
            self.feed.add(index, blob)
            self.applied_through = index
        self.feed.on_add()
        return index, result


# Sends a batch of packed commands as one log entry within `timeout` seconds: each
# command's result, in order, and the entry's log index. Raises NoQuorum.
SendBatch = Callable[[list[bytes], float], Awaitable[tuple[list[Any], int]]]


@dataclass(eq=False)
class _Pending:
    blob: bytes
    queued: bool = True
    abandoned: bool = False
    done: bool = False
    result: Any = None
    index: int = 0
    error: NoQuorum | None = None


class Batcher:
    """Group commit: the commands submitted while `in_flight` batches are on their way to
    the log go together, as one entry, in the next batch. A lone command goes at once,
    alone (no added latency); under load, one log entry (one round of messages to every
    voter, one journal write) carries many commands. A batch is sent by one of the tasks
    whose command it carries; a batch that fails fails all its commands with NoQuorum,
    and their callers resubmit them (commands are exactly-once by transaction id)."""

    def __init__(self, send: SendBatch, in_flight: int = BATCHES_IN_FLIGHT,
                 max_bytes: int = BATCH_BYTES, max_commands: int = BATCH_COMMANDS) -> None:
        self._send = send
        self.in_flight_limit = in_flight
        self.max_bytes = max_bytes
        self.max_commands = max_commands
        self._queue: deque[_Pending] = deque()
        self._in_flight = 0
        self._changed = trio.Event()
        self.batches = 0
        self.commands = 0

    async def submit(self, blobs: list[bytes], timeout: float) -> tuple[list[Any], int]:
        """Commit the commands; their results and the highest log index they came in."""
        mine = [_Pending(b) for b in blobs]
        self._queue.extend(mine)
        deadline = trio.current_time() + timeout
        # Commands are taken into a batch until `deadline`. A batch on its way is waited
        # for, not cancelled: its send is bounded by itself (the raft member's answer
        # wait, ANSWER_GRACE past its timeout), and its answer says whether the commands
        # are in the log: a leader that lost its majority steps down and refuses them,
        # then they are known to be in no log (EIO, not in doubt).
        with trio.move_on_at(deadline + ANSWER_GRACE + 1):
            while not all(p.done for p in mine):
                queued = any(p.queued for p in mine)
                if queued and trio.current_time() >= deadline:
                    break
                if queued and self._in_flight < self.in_flight_limit:
                    await self._send_next(deadline)
                    continue
                with trio.move_on_at(deadline if queued else math.inf):
                    await self._changed.wait()
        for p in mine:
            if p.error is not None:
                raise p.error
        if not all(p.done for p in mine):
            for p in mine:
                p.abandoned = True
            e = NoQuorum(f"the log took no command within {timeout:.1f}s")
            # Commands still queued were never handed to a leader: they are in no log
            # (the abandoned ones are skipped when a batch is made).
            e.maybe_sent = any(not p.queued for p in mine)
            raise e
        return [p.result for p in mine], max(p.index for p in mine)

    async def _send_next(self, deadline: float) -> None:
        batch: list[_Pending] = []
        size = 0
        while self._queue and len(batch) < self.max_commands:
            p = self._queue[0]
            if p.abandoned:
                self._queue.popleft()
                continue
            if batch and size + len(p.blob) > self.max_bytes:
                break
            self._queue.popleft()
            p.queued = False
            batch.append(p)
            size += len(p.blob)
        if not batch:
            return
        self._in_flight += 1
        self.batches += 1
        self.commands += len(batch)
        try:
            results, index = await self._send([p.blob for p in batch],
                                              max(0.05, deadline - trio.current_time()))
            if len(results) != len(batch):
                raise NoQuorum(f"a batch of {len(batch)} commands got {len(results)} results")
            for p, r in zip(batch, results, strict=True):
                p.result, p.index = r, index
        except NoQuorum as e:
            for p in batch:
                p.error = e
        finally:
            for p in batch:
                if not p.done and p.error is None and p.index == 0:
                    p.error = NoQuorum("the task sending this command's batch was cancelled")
                p.done = True
            self._in_flight -= 1
            self._changed.set()
            self._changed = trio.Event()


class RaftNode:
    def __init__(self, self_addr: str, partners: list[str], data_dir: Path,
                 secret: str, state: StateMachine, on_applied: Applied = _ignore,
                 joining: bool = False, wiped: bool = False,
                 compact_entries: int = COMPACT_ENTRIES) -> None:
        """`joining`: we start with no log into a group that has one; we neither vote
        nor stand for election until caught up (objcache/raft/follower_fix.py). `wiped`:
        the group counts our address as a voter already (our cache dir was lost); until
        caught up we do not count toward a commit either.

        The mark (JOINING_MARK) stays on disk until caught up. A wiped voter killed
        during its catch-up restarts with part of the log, and its journal alone would
        let it vote as if it held every entry it acknowledged before the wipe: it
        restarts wiped and joining again. A promoted member (never wiped) killed while
        joining holds every entry it acknowledged in its journal, which is all Raft asks
        of a voter: it restarts voting. (Kept joining, it stalled a group of two killed
        at once a moment after the second member's promotion: the first needed its vote,
        and it waited for a leader; a CI run of 2026-11-27, test_restart.py.) A mark
        that does not say which (written before 2026-11-27) counts as wiped."""
        data_dir.mkdir(parents=True, exist_ok=True)
        mark = data_dir / JOINING_MARK
        if mark.exists():
            if mark.read_bytes() == MARK_JOINING:
                mark.unlink()
                log.info("raft: restarted before catching up with the group's log; its "
                         "journal holds all it acknowledged: voting")
            else:
                joining = wiped = True
                log.info("raft: restarted before catching up with the group's log after "
                         "losing it; not voting until caught up")
        elif joining:
            mark.write_bytes(MARK_WIPED if wiped else MARK_JOINING)
        self.addr = self_addr
        conf = make_conf(data_dir, self_addr, compact_entries)
        conf.onStateChanged = self._role_changed
        self._replica = _Replica(self_addr, [p for p in partners if p != self_addr],
                                 conf, secret, state, on_applied,
                                 joining, wiped, mark if joining else None)
        self.batcher = Batcher(self._send_batch)
        self._stopped = False  # destroyed: calls waiting on it fail at once (`_call`)
        self.handovers = 0  # leadership transfers begun here (a lease ends with each)
        self.handing_over = False  # while one runs, no promise is asked of the voters

    def _role_changed(self, old: int, new: int) -> None:
        """Leading and stepping down, logged (on pysyncobj's thread): which member led
        when is otherwise not in the logs, and a partition's failures are read from them
        (seed 5968's leader could only be inferred)."""
        if LEADER not in (old, new):
            return
        replica = getattr(self, "_replica", None)
        term = replica._SyncObj__raftCurrentTerm if replica is not None else "?"
        if new == LEADER:
            log.info("raft: leading, term %s", term)
        else:
            log.info("raft: no longer leading (now %s), term %s", ROLES.get(new, new), term)

    @property
    def feed(self) -> Feed:
        return self._replica.feed

    @property
    def voting(self) -> bool:
        """False while joining (objcache/raft/follower_fix.py, rule 3)."""
        return not self._replica.joining

    @property
    def state(self) -> Any:
        return self._replica.state  # a loaded dump replaces the object: never keep it

    async def _call(self, what: str, start: Any, timeout: float,
                    leaderless: float = math.inf) -> Any:
        """Run a pysyncobj call that reports through callback(result, error) and wait for
        it from trio; NoQuorum if it fails or does not answer within `timeout`. While
        there is no leader (or ours is not connected) it is tried again every 50 ms, for
        `leaderless` seconds at most. NoQuorum.maybe_sent says whether an attempt may have
        reached a leader's log."""
        token = trio.lowlevel.current_trio_token()
        now = trio.current_time()
        retry_until = now + timeout  # (an unsent command: no later)
        deadline = retry_until + ANSWER_GRACE  # (the answer to one that was sent)
        leaderless_until = min(retry_until, now + leaderless)
        sent = False
        while True:
            if self._stopped:
                raise NoQuorum(f"raft {what}: this member stopped")
            if not self.leader_reachable():
                error: Any = FAIL_REASON.MISSING_LEADER
            else:
                sent = True
                done = trio.Event()
                box: dict[str, Any] = {}

                def callback(result: Any, error: Any, box: dict[str, Any] = box,
                             done: trio.Event = done) -> None:  # on pysyncobj's thread
                    box["result"], box["error"] = result, error
                    token.run_sync_soon(done.set)

                start(callback)
                # (polled: a member stopped meanwhile never answers; its caller tries the
                # member that replaced it instead of waiting out the timeout. A voter the
                # group removed, turned learner, held a flush's claim for its whole 5 s
                # and failed the flush: the partition nemesis with learners, seed 4303)
                # A command handed to a leader that is then gone (we led, and no
                # majority answers us; our leader went silent) is answered by nobody:
                # pysyncobj fails what a follower forwarded only when it stands for
                # election or learns of another leader, and a leader's uncommitted
                # commands when entries at their indexes are applied. Given up then, as
                # maybe in the log: its submitter sends it again (exactly once, by its
                # transaction id), a learner's through another voter. Two such batches
                # held a voter cut off by a bridged partition for their whole timeout,
                # and the learner's close queued behind them answered EIO while every
                # node was reachable (partition seed 5968). (It was reachable when sent:
                # the check above.)
                while not done.is_set() and not self._stopped:
                    with trio.move_on_at(min(deadline, trio.current_time() + STOP_POLL)):
                        await done.wait()
                    if trio.current_time() >= deadline or done.is_set():
                        break
                    if not self.leader_reachable():
                        e = NoQuorum(f"raft {what}: its leader was gone before it answered")
                        e.maybe_sent = True
                        raise e
                if not done.is_set():
                    e = NoQuorum(f"raft {what}: this member stopped before it was answered"
                                 if self._stopped else
                                 f"raft {what} got no answer in {timeout:.0f}s")
                    e.maybe_sent = True
                    raise e
                error = box["error"]
                if error in (FAIL_REASON.SUCCESS, None):
                    return box["result"]
                if error not in _NOT_SENT:
                    e = NoQuorum(f"raft {what} failed: {_reason(error)}")
                    e.maybe_sent = True
                    raise e
            if (error != FAIL_REASON.MISSING_LEADER
                    or trio.current_time() + 0.05 > leaderless_until):
                e = NoQuorum(f"raft {what} failed: {_reason(error)}")
                e.maybe_sent = sent and error not in _NOT_SENT
                raise e
            await trio.sleep(0.05)

    def leader_reachable(self) -> bool:
        """Whether our member has a leader that can commit what we send it: itself, while
        a majority of the voters answered it within LEADER_SILENT, or a partner it is
        connected to and heard from within LEADER_SILENT. pysyncobj keeps the last
        leader of a follower that is connected to nobody (it never becomes a candidate),
        and would hand commands to a connection that is gone; and a leader cut off from
        the majority takes commands it cannot commit until it steps down, 3.5 s on."""
        st = self._replica.getStatus()
        leader = st.get("leader")
        if leader is None:
            return False
        if str(leader) == self.addr:
            return self._replica.majority_heard(LEADER_SILENT)
        return (st.get(f"{_PARTNER}{leader}") == _CONNECTED
                and monotonic() - self._replica.heard_leader_at < LEADER_SILENT)

    async def submit(self, cmd: dict[str, Any], timeout: float = 10.0,
                     background: bool = False) -> Any:
        """Commit `cmd` through the log and return what applying it returned.
        (`background`: as for a learner; a voter applies every entry as it commits.)"""
        results, _ = await self.batcher.submit([pack(cmd)], timeout)
        return results[0]

    async def submit_indexed(self, cmd: dict[str, Any], timeout: float = 10.0
                             ) -> tuple[Any, int]:
        """`submit`, and the index of the log entry the command came in."""
        results, index = await self.batcher.submit([pack(cmd)], timeout)
        return results[0], index

    async def _send_batch(self, blobs: list[bytes], timeout: float) -> tuple[list[Any], int]:
        # One command travels as itself; several as an array of their packed bytes.
        blob = blobs[0] if len(blobs) == 1 else msgpack.packb(blobs, use_bin_type=True)
        got = await self._call(f"batch of {len(blobs)}", lambda cb: self._replica._apply(
            blob, callback=cb), timeout, leaderless=LEADERLESS_BATCH)
        index, result = got
        return ([result] if len(blobs) == 1 else list(result)), int(index)

    def applied_index(self) -> int:
        """The last log index applied here (a command's own index once its answer came)."""
        r = self._replica
        return max(int(r.raftLastApplied), r.applied_through)

    def fed_index(self) -> int:
        """The index through which the feed holds every command applied here: the applied
        index, but only what the feed holds while pysyncobj loads a snapshot of its own
        (the feed learns of the new state at the next entry)."""
        r = self._replica
        with r.feed.lock:
            if r.state is not r._fed_state:
                return r.feed.last or r.feed.base
            return int(r.raftLastApplied)

    def snapshot(self) -> tuple[bytes, int]:
        """The state, pickled, and the log index it reflects (for a learner)."""
        r = self._replica
        with r.feed.lock:
            if r.state is not r._fed_state:
                # pysyncobj is loading a snapshot of its own: its index may not match yet
                raise NoQuorum("this member is loading a snapshot")
            index = r.feed.last or int(r.raftLastApplied)
            return pickle.dumps(r.state, protocol=pickle.HIGHEST_PROTOCOL), index

    def members(self) -> list[str]:
        """The Raft group as this node's log has it (itself included)."""
        # (pysyncobj's getStatus builds a dict of every partner's indexes: this is asked
        # for every feed answer)
        return sorted([self.addr, *(n.id for n in self._replica.otherNodes)])

    def feed_header(self) -> FeedHeader:
        """What a feed answer tells the learner about the group, without a full status:
        a voter answers several learners for every entry."""
        r = self._replica
        leader = r._getLeader()
        return FeedHeader(self.members(), None if leader is None else str(leader),
                          int(r.raftCurrentTerm or 0), int(r.raftCommitIndex or 0))

    def term(self) -> int:
        return int(self._replica.raftCurrentTerm or 0)

    def heard_from(self, addr: str) -> bool:
        """As leader: whether the voter at `addr` answered our appends within
        leaderFallbackTimeout, the measure pysyncobj itself counts a majority by. (pysyncobj
        counts every voter as heard at the election and when it is added: a new leader
        takes that long to find a voter silent.)"""
        r = self._replica
        if not r._isLeader():
            return False
        deadline = monotonic() - r._SyncObj__conf.leaderFallbackTimeout
        # (pysyncobj's thread writes the map: a copy, taken at once under the GIL)
        seen = list(r._SyncObj__lastResponseTime.items())
        return any(n.id == addr and t > deadline for n, t in seen)

    def leading(self) -> tuple[int, int] | None:
        """(term, commit index) while this member leads; None otherwise. pysyncobj's
        fields, read from the trio thread: the term is read before and after, so both
        belong to one term in which we led (a leader that steps down keeps its term but
        stops leading; one that meets a later term changes it)."""
        r = self._replica
        term = r.raftCurrentTerm
        if not r._isLeader():
            return None
        commit = r.raftCommitIndex
        if r.raftCurrentTerm != term or not r._isLeader():
            return None
        return int(term), int(commit)

    async def promise(self, seconds: float, term: int, timeout: float = PROMISE_WAIT
                      ) -> tuple[int, bool]:
        """Promise to vote for no candidate and to stand for no election for `seconds`
        (objcache/raft/follower_fix.py, 4.), to the leader of `term`: our term once the
        promise holds, and whether we follow a leader in it (or lead). False too if
        pysyncobj's thread did not end its tick within `timeout`: the promise holds all
        the same, but what the term was when it began is not known. No promise at all
        while our term is another or we follow no leader: a member back from a partition
        with a later term than the leader's refuses its appends and must stand for
        election to be heard, and a promise to each of the leader's rounds held its
        candidacy off for as long as the leader renewed its lease (the partition
        nemesis, seed 5005: 18-33 s without a leader on that node)."""
        r = self._replica
        if self.term() != term or not self._following():
            return self.term(), False
        token = trio.lowlevel.current_trio_token()
        kept = trio.Event()

        def on_kept() -> None:  # (pysyncobj's thread)
            try:
                token.run_sync_soon(kept.set)
            except trio.RunFinishedError:
                pass

        r.promise(seconds, on_kept)
        with trio.move_on_after(timeout):
            await kept.wait()
        now = self.term()
        return now, kept.is_set() and now == term and self._following()

    def _following(self) -> bool:
        """Whether we lead, or follow a leader, in our current term."""
        r = self._replica
        return bool(r._isLeader()) or (r._SyncObj__raftLeader is not None
                                       and r._SyncObj__raftState == FOLLOWER)

    def last_command(self) -> int:
        """The index of the last command entry applied here (0: none since the state was
        loaded)."""
        return self._replica.feed.last

    async def add_member(self, addr: str, timeout: float = 10.0) -> None:
        """Add a node to the group (one change at a time, through the log)."""
        if addr in self.members():
            return
        await self._call(f"add of {addr}",
                         lambda cb: self._replica.addNodeToCluster(addr, callback=cb), timeout)

    async def remove_member(self, addr: str, timeout: float = 10.0) -> None:
        if addr not in self.members():
            return
        await self._call(f"removal of {addr}",
                         lambda cb: self._replica.removeNodeFromCluster(addr, callback=cb),
                         timeout)

    async def step_down(self, timeout: float = 5.0) -> bool:
        """Hand leadership to the most caught-up follower (Raft TimeoutNow); whether we
        are no longer the leader within `timeout`. pysyncobj refuses a leader's removal
        of itself, so a leaving leader steps down first; it stands for no election after
        (it leaves: objcache/raft/follower_fix.py, 4.)."""
        # No lease from now on (objcache/cluster/readindex.py), and no new promise asked:
        # the voters' promises would refuse the successor their votes. Those made already
        # end first (each voter's began after ours, which we made in the same round; a
        # voter that got its question late may refuse a first vote, and the successor
        # stands again after its election timeout).
        self.handovers += 1
        self.handing_over = True
        try:
            # (our promise's end, on pysyncobj's clock: a restarted member's 1 s too)
            wait = self._replica.promise_until - monotonic()
            if wait > 0:
                await trio.sleep(wait + PROMISE_SLACK)
            self._replica.release()
            self._replica.leaving = True
            give_up = trio.current_time() + TRANSFER_TRIES
            while True:
                try:
                    await self._call("leadership transfer",
                                     lambda cb: self._replica.transferLeadership(callback=cb),
                                     2.0)
                    break
                except NoQuorum:
                    # pysyncobj hands over only to a follower that holds our whole log:
                    # under writes, only between an acknowledgement and the next entry
                    # (refused at the first try in 2 of 3 drains measured; the leader then
                    # led until it left, and the group waited an election timeout)
                    if self.status()["role"] != "leader":
                        return True
                    if trio.current_time() >= give_up:
                        return False
                    await trio.sleep(TRANSFER_RETRY)
            with trio.move_on_after(timeout):
                while self.status()["role"] == "leader":
                    await trio.sleep(0.05)
                return True
            return False
        finally:
            self.handing_over = False

    def status(self) -> dict[str, Any]:
        st = self._replica.getStatus()
        leader = st.get("leader")
        return {"role": ROLES.get(st.get("state"), str(st.get("state"))),
                "voter": True,
                "term": st.get("raft_term"), "commit_index": st.get("commit_idx"),
                "last_applied": st.get("last_applied"),
                "apply_lag": max(0, (st.get("commit_idx") or 0) - (st.get("last_applied") or 0)),
                "leader": None if leader is None else str(leader),
                "partners": st.get("partner_nodes_count"),
                "connected": sorted(k[len(_PARTNER):] for k, v in st.items()
                                    if k.startswith(_PARTNER) and v == _CONNECTED),
                "log_entries": st.get("log_len"),
                "commands": getattr(self.state, "applied", None),
                "batches": self.batcher.batches, "batched_commands": self.batcher.commands,
                "thread_cpu_seconds": self._thread_cpu(),
                "voting": self.voting}

    def _thread_cpu(self) -> float | None:
        """CPU time of pysyncobj's thread (all Raft messaging, the journal, applying)."""
        thread = getattr(self._replica, "_SyncObj__thread", None)
        tid = getattr(thread, "native_id", None)
        if tid is None:
            return None
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)

    def destroy(self) -> None:
        self._stopped = True
        self._replica.destroy()

    def destroy_synchronous(self) -> None:
        """Stop, and return once pysyncobj's thread has ended (nothing applies after)."""
        self._stopped = True
        self._replica.destroy_synchronous()


# Answers after which the command is in no log: pysyncobj did not hand it to a leader
# (none, or its queue was full), the leader refused it, the node asked was no longer the
# leader, or the entry it got was replaced by another term's (DISCARDED).
_NOT_SENT = {FAIL_REASON.MISSING_LEADER, FAIL_REASON.QUEUE_FULL, FAIL_REASON.REQUEST_DENIED,
             FAIL_REASON.NOT_LEADER, FAIL_REASON.DISCARDED}
_CONNECTED = 2  # pysyncobj's CONNECTION_STATE.CONNECTED in getStatus()
_PARTNER = "partner_node_status_server_"


def _reason(code: int) -> str:
    for name in dir(FAIL_REASON):
        if not name.startswith("_") and getattr(FAIL_REASON, name) == code:
            return name.lower().replace("_", " ")
    return str(code)

