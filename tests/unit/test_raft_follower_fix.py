"""The follower side of append_entries as objcache runs it on top of pysyncobj 0.3.17
(objcache/raft/follower_fix.py): Raft section 5.3 rules that pysyncobj alone breaks. A
replica that never ticks is fed messages directly; its replies are recorded."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import FAIL_REASON
from pysyncobj.monotonic import monotonic
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.transport import TCPTransport

from objcache.raft.follower_fix import MAX_PROMISE
from objcache.raft.guard import KEEPALIVE, KEEPALIVE_MESSAGE
from objcache.raft.node import JOINING_MARK, RaftNode, _Replica, make_conf
from objcache.txn.state import ClusterState
from tests.helpers.cluster import free_port

CMD = b"\x00cmd"  # a regular command (type byte 0); never applied here


class Follower:
    def __init__(self, tmp: Path, joining: bool = False, wiped: bool = False,
                 mark: Path | None = None) -> None:
        conf = make_conf(tmp)
        conf.autoTick, conf.journalFile, conf.fullDumpFile = False, None, None
        self.replica = _Replica(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"],
                                conf, "secret", ClusterState(), joining=joining, wiped=wiped,
                                joining_mark=mark)
        self.leader = next(iter(self.replica._SyncObj__otherNodes))
        self.sent: list[dict[str, Any]] = []
        self.replica._SyncObj__transport.send = lambda node, msg: self.sent.append(msg)

    def load(self, terms: list[int], commit: int, term: int) -> None:
        """Our log becomes index 1 (pysyncobj's initial entry) then one entry per term."""
        r = self.replica
        for i, t in enumerate(terms, start=2):
            r._SyncObj__raftLog.add(CMD, i, t)
        r._SyncObj__raftCommitIndex = r._SyncObj__raftLastApplied = commit
        r._SyncObj__raftCurrentTerm = term

    def append(self, term: int, prev: tuple[int, int], entries: list[tuple[int, int]],
               commit: int) -> dict[str, Any]:
        self.sent.clear()
        self.replica._SyncObj__onMessageReceived(self.leader, {
            "type": "append_entries", "term": term, "commit_index": commit,
            "entries": [(CMD, i, t) for i, t in entries],
            "prevLogIdx": prev[0], "prevLogTerm": prev[1]})
        assert len(self.sent) == 1
        return self.sent[0]

    def vote(self, term: int, last: tuple[int, int]) -> list[dict[str, Any]]:
        """Ask for our vote; what we answered."""
        self.sent.clear()
        self.replica._SyncObj__onMessageReceived(self.leader, {
            "type": "request_vote", "term": term, "last_log_index": last[0],
            "last_log_term": last[1]})
        return list(self.sent)

    def log(self) -> list[tuple[int, int]]:
        return [(e[1], e[2]) for e in self.replica._SyncObj__raftLog][1:]

    @property
    def commit(self) -> int:
        return int(self.replica._SyncObj__raftCommitIndex)


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[Follower]:
    f = Follower(tmp_path)
    yield f
    f.replica.destroy()


def test_resent_prefix_keeps_applied_tail(follower: Follower,
                                          caplog: pytest.LogCaptureFixture) -> None:
    follower.load([1] * 9, commit=10, term=1)  # indexes 2..10, all applied
    with caplog.at_level(logging.CRITICAL):
        reply = follower.append(2, (3, 1), [(4, 1), (5, 1), (6, 1)], commit=10)
    assert follower.log() == [(i, 1) for i in range(2, 11)]
    assert reply == {"type": "next_node_idx", "next_node_idx": 7, "reset": False,
                     "success": True}
    assert follower.commit == 10
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]


def test_unverified_tail_is_neither_acknowledged_nor_committed(follower: Follower) -> None:
    follower.load([1] * 4, commit=1, term=1)  # 2..5 of term 1, none known committed
    reply = follower.append(2, (3, 1), [], commit=50)  # a heartbeat of the term-2 leader
    assert reply["success"] and reply["next_node_idx"] == 4
    assert follower.commit == 3  # 4 and 5 may conflict with the leader's log
    assert follower.log() == [(i, 1) for i in range(2, 6)]


def test_a_part_of_a_snapshot_commits_nothing_of_our_log(follower: Follower) -> None:
    """A deposed leader back from a partition (its entries 4-6 of term 2 never committed)
    is sent the new leader's dump in parts: pysyncobj set its commit index to its own
    log's end at the first part, and it applied its uncommitted entries (seeds 5911 and
    5949: a write-back claim answered "ok" that the majority never had)."""
    follower.load([1, 1, 2, 2, 2], commit=3, term=2)
    follower.sent.clear()
    follower.replica._SyncObj__onMessageReceived(follower.leader, {
        "type": "append_entries", "term": 3, "commit_index": 50,
        "serialized": (b"the first 64 KiB of the dump", True, False)})
    assert follower.commit == 3
    assert follower.log() == [(2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]


def test_a_whole_snapshot_counts_as_committed_through_its_end(tmp_path: Path) -> None:
    """The other half of rule 5: with its parts capped, the loaded dump itself raises the
    commit index to the dump's end (it holds only what the leader applied). Left at the
    deposed leader's old commit index, it would count less committed than it applied. Our
    commands in entries the dump covers are answered then (seed 5963: one waited for its
    timeout)."""
    leader = Follower(tmp_path / "leader")
    deposed = Follower(tmp_path / "deposed")
    try:
        lr = leader.replica
        leader.load([1, 1, 3, 3], commit=5, term=3)  # 2..5 applied by the term-3 leader
        lr._SyncObj__forceLogCompaction = True
        lr._SyncObj__tryLogCompaction()  # (in memory: the dump is made at once...)
        lr._SyncObj__tryLogCompaction()  # (...and sent once the next tick has seen it)
        deposed.load([1, 1, 2, 2, 2], commit=3, term=2)  # 4..6 of term 2 never committed
        answers: list[tuple[int, Any]] = []
        for idx in (5, 6):  # our own commands, in entries 5 and 6 of term 2
            deposed.replica._SyncObj__commandsWaitingCommit[idx].append(
                (2, lambda result, error, idx=idx: answers.append((idx, error))))
        part = None
        while part is None or not part[2]:
            part = lr._SyncObj__serializer.getTransmissionData(deposed.leader)
            assert part
            deposed.replica._SyncObj__onMessageReceived(deposed.leader, {
                "type": "append_entries", "term": 3, "commit_index": 5,
                "serialized": part})
            if not part[2]:
                assert deposed.commit == 3  # (the first half of rule 5)
        r = deposed.replica
        assert deposed.log() == [(5, 3)]  # the dump's last two entries: 4 and 5 of term 3
        assert deposed.commit == 5 and r._SyncObj__raftLastApplied == 5
        # Our command in entry 5 is answered now (the dump covers that index: nothing will
        # be applied there again); the one in 6 when the leader's entry 6 is applied.
        assert answers == [(5, FAIL_REASON.LEADER_CHANGED)]
        assert list(r._SyncObj__commandsWaitingCommit) == [6]
    finally:
        leader.replica.destroy()
        deposed.replica.destroy()


def test_leaders_own_term_tail_is_acknowledged(follower: Follower) -> None:
    follower.load([1, 2, 2, 2], commit=1, term=2)
    reply = follower.append(2, (2, 1), [(3, 2)], commit=50)
    assert reply["success"] and reply["next_node_idx"] == 6
    assert follower.commit == 5


def test_conflicting_entries_are_replaced(follower: Follower) -> None:
    follower.load([1] * 4, commit=1, term=1)
    reply = follower.append(2, (2, 1), [(3, 1), (4, 2)], commit=4)
    assert follower.log() == [(2, 1), (3, 1), (4, 2)]
    assert reply["success"] and reply["next_node_idx"] == 5
    assert follower.commit == 4


def test_rejection_asks_from_the_commit_index_when_tail_is_another_term(
        follower: Follower) -> None:
    # An old leader restarted from its journal: a long tail of its own term past the
    # commit index. pysyncobj alone answers "beyond my log" with its last index + 1 and a
    # mismatch with prevLogIdx, alternately, and never catches up.
    follower.load([1] * 9, commit=4, term=1)
    beyond = follower.append(3, (20, 3), [(21, 3)], commit=30)
    mismatch = follower.append(3, (8, 2), [(9, 3)], commit=30)
    assert beyond["reset"] and not beyond["success"] and beyond["next_node_idx"] == 5
    assert mismatch["reset"] and mismatch["next_node_idx"] == 5
    # resent from there: known entries are trimmed, the conflict replaced, nothing lost
    ok = follower.append(3, (4, 1), [(5, 1), (6, 1), (7, 2), (8, 3)], commit=8)
    assert ok["success"] and ok["next_node_idx"] == 9
    assert follower.log() == [(2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 2), (8, 3)]


def test_rejection_in_leaders_term_asks_for_the_next_entry(follower: Follower) -> None:
    follower.load([1, 3, 3], commit=2, term=3)
    reply = follower.append(3, (20, 3), [(21, 3)], commit=30)
    assert reply["reset"] and reply["next_node_idx"] == 5


def test_member_without_a_log_votes_only_once_caught_up(tmp_path: Path) -> None:
    # Seed 1101 of the partition nemesis: a voter's cache dir was wiped and it came back at
    # its old address with an empty log. Its vote let a candidate missing committed entries
    # win, and the acknowledged files in those entries were lost.
    f = Follower(tmp_path, joining=True)
    try:
        assert f.vote(5, (3, 2)) == []  # any candidate would be "at least as up to date"
        # the leader of term 6 sends entries of old terms: still not caught up
        f.append(6, (1, 0), [(2, 1), (3, 2)], commit=3)
        assert f.replica.joining and f.vote(7, (3, 2)) == []
        # an entry of the leader's own term committed: every earlier one is in our log
        f.append(6, (3, 2), [(4, 6)], commit=4)
        assert not f.replica.joining
        assert f.vote(7, (4, 6)) == [{"type": "response_vote", "term": 7}]
    finally:
        f.replica.destroy()


def test_member_with_its_log_votes_as_before(follower: Follower) -> None:
    assert follower.vote(5, (3, 2)) == [{"type": "response_vote", "term": 5}]


def test_member_without_a_log_does_not_count_for_a_leader_of_an_older_term(
        tmp_path: Path) -> None:
    # test_voter_back_without_its_log_cannot_elect_a_stale_node failed once: a was the
    # term-1 leader and froze, b and c committed 14..33 in term 2, b froze, c came back
    # wiped, and a, thawed before its leaderFallbackTimeout, still led term 1. c took a's
    # term-1 commit index (13) for "caught up", acknowledged 14..16, a committed them with
    # c, and b's log later replaced them after both had applied them (k0 lost).
    f = Follower(tmp_path, joining=True, wiped=True)
    try:
        r = f.replica
        reply = f.append(1, (1, 0), [(i, 1) for i in range(2, 14)], commit=13)
        assert f.commit == 13 and r.joining  # committed before we heard from it
        assert reply == {"type": "next_node_idx", "next_node_idx": 14, "reset": True,
                         "success": False, "joining": True}
        reply = f.append(1, (13, 1), [(14, 1), (15, 1)], commit=13)
        assert not reply["success"] and reply["next_node_idx"] == 16 and r.joining
        assert f.vote(2, (13, 1)) == []
        # the current leader (term 3) commits an entry of its own term after we heard
        # from it: a majority of the others acknowledged it, so its log is the group's
        f.append(3, (13, 1), [(14, 2), (15, 3)], commit=13)
        assert r.joining
        f.append(3, (15, 3), [(16, 3)], commit=16)
        assert not r.joining and f.log()[-3:] == [(14, 2), (15, 3), (16, 3)]
        reply = f.append(3, (16, 3), [(17, 3)], commit=16)
        assert reply == {"type": "next_node_idx", "next_node_idx": 18, "reset": False,
                         "success": True}
    finally:
        f.replica.destroy()


def test_leader_forgets_what_a_wiped_members_previous_incarnation_acknowledged(
        follower: Follower) -> None:
    r = follower.replica
    r._SyncObj__raftMatchIndex[follower.leader] = 15  # acknowledged before the wipe
    r._SyncObj__onMessageReceived(follower.leader, {
        "type": "next_node_idx", "next_node_idx": 1, "reset": True, "success": False,
        "joining": True})
    assert r._SyncObj__raftMatchIndex[follower.leader] == 0


def test_a_wiped_member_killed_while_joining_restarts_wiped(tmp_path: Path) -> None:
    # A wiped voter killed before it caught up: its journal holds part of the log, and on
    # its own it would let the restart vote as if it held every entry it acknowledged
    # before the wipe. The mark in its data dir keeps it joining and wiped until it
    # catches up; so does a mark that does not say (written before it did).
    addr, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState(), joining=True,
                    wiped=True)
    try:
        assert (tmp_path / JOINING_MARK).exists() and not node.voting
    finally:
        node.destroy_synchronous()
    for _ in range(2):
        node = RaftNode(addr, [other], tmp_path, "secret", ClusterState())
        try:
            assert not node.voting and node._replica.wiped
        finally:
            node.destroy_synchronous()
        (tmp_path / JOINING_MARK).write_bytes(b"")


def test_a_promoted_member_killed_while_joining_restarts_voting(tmp_path: Path) -> None:
    # Promoted with an empty journal, it has lost nothing it acknowledged: its journal is
    # all Raft asks of a voter. Kept joining, it stalled a group of two killed at once
    # (the other needed its vote, and it waited for a leader: test_restart.py in CI).
    addr, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState(), joining=True)
    try:
        assert (tmp_path / JOINING_MARK).exists() and not node.voting
    finally:
        node.destroy_synchronous()
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState())
    try:
        assert node.voting and not node._replica.wiped
        assert not (tmp_path / JOINING_MARK).exists()
    finally:
        node.destroy_synchronous()


def test_the_joining_mark_goes_once_caught_up(tmp_path: Path) -> None:
    mark = tmp_path / JOINING_MARK
    mark.write_bytes(b"")
    f = Follower(tmp_path, joining=True, mark=mark)
    try:
        f.append(6, (1, 0), [(2, 1), (3, 6)], commit=2)
        assert f.replica.joining and mark.exists()
        f.append(6, (3, 6), [], commit=3)
        assert not f.replica.joining and not mark.exists()
    finally:
        f.replica.destroy()


def test_a_promise_holds_our_vote_but_not_our_term(follower: Follower) -> None:
    # Rule 4 (the leader's lease): while it promised, a member grants no vote, whatever
    # the candidate's log; after, it votes as before.
    r = follower.replica
    follower.load([1, 2], commit=3, term=2)
    r._SyncObj__raftLeader = follower.leader
    kept: list[int] = []
    r.promise(0.5, lambda: kept.append(1))
    assert follower.vote(5, (9, 4)) == []
    # The candidate's term is ours now, and we follow no leader in it: a member that came
    # back from a partition with a term the group never had is refused our vote, but the
    # leader's appends in the lower term are refused too, until a leader of this term
    # (the partition nemesis, seed 5005: the node back never found a leader while the old
    # one renewed its lease).
    assert r._SyncObj__raftCurrentTerm == 5 and r._SyncObj__raftLeader is None
    assert r._SyncObj__votedForNodeId is None
    follower.sent.clear()
    r._SyncObj__onMessageReceived(follower.leader, {
        "type": "append_entries", "term": 2, "commit_index": 3, "entries": [],
        "prevLogIdx": 3, "prevLogTerm": 2})
    assert follower.sent == [] and r._SyncObj__raftLeader is None
    r.promise_until = monotonic() - 0.01  # (ended)
    assert follower.vote(5, (9, 4)) == [{"type": "response_vote", "term": 5}]
    assert kept == []  # no tick has ended since (this member does not tick by itself)


def test_a_promise_holds_our_candidacy_and_is_kept_at_the_end_of_a_tick(
        follower: Follower, monkeypatch: pytest.MonkeyPatch) -> None:
    r = follower.replica
    follower.load([1, 2], commit=3, term=2)
    monkeypatch.setattr(r, "_SyncObj__connectedToAnyone", lambda: True)
    kept: list[int] = []
    r.promise(0.5, lambda: kept.append(r._SyncObj__raftCurrentTerm))
    r._SyncObj__raftElectionDeadline = 0  # we heard from no leader for long
    r._onTick(0.0)
    assert kept == [2]  # called once the tick ended, in the term of the promise
    assert r._SyncObj__raftCurrentTerm == 2 and r._SyncObj__raftState == 0  # follower
    r.promise_until = monotonic() - 0.01
    r._SyncObj__raftElectionDeadline = 0
    r._onTick(0.0)
    assert r._SyncObj__raftCurrentTerm == 3 and r._SyncObj__raftState == 1  # candidate
    assert kept == [2]


def test_a_member_restarted_from_its_journal_keeps_the_longest_promise(
        tmp_path: Path) -> None:
    # It may have promised before it stopped, and kept no record of it.
    addr, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState())
    try:
        assert node._replica.promise_until == 0.0  # (a new member promised nothing)
    finally:
        node.destroy_synchronous()
    started = monotonic()
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState())
    try:
        assert node._replica.promise_until >= started + MAX_PROMISE
    finally:
        node.destroy_synchronous()


async def test_a_promise_is_made_only_to_the_leader_we_follow(tmp_path: Path) -> None:
    # Seed 5005 of the partition nemesis: a member back from a partition with a later term
    # than the leader's answered each of the leader's rounds with a promise, which held
    # off its own candidacy, the only way its term could reach the group: it found no
    # leader for 18-33 s.
    addr, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [other], tmp_path, "secret", ClusterState())
    r = node._replica
    try:
        term = node.term()
        assert await node.promise(0.5, term) == (term, False)  # no leader known
        assert r.promise_until == 0.0
        r._SyncObj__raftLeader = next(iter(r._SyncObj__otherNodes))  # (we follow it)
        assert await node.promise(0.5, term + 1) == (term, False)  # another term
        assert r.promise_until == 0.0
        started = monotonic()
        assert await node.promise(0.5, term) == (term, True)  # kept after a tick
        assert started + 0.5 <= r.promise_until <= monotonic() + 0.5
    finally:
        node.destroy_synchronous()


def test_a_leader_that_hands_over_to_leave_stands_for_no_election(
        follower: Follower, monkeypatch: pytest.MonkeyPatch) -> None:
    # A drained leader stood again while its successor's first election failed, won the
    # next term and left: commits waited for a third election (docs/operations.md).
    r = follower.replica
    follower.load([1, 2], commit=3, term=2)
    monkeypatch.setattr(r, "_SyncObj__connectedToAnyone", lambda: True)
    r.leaving = True
    r._SyncObj__raftElectionDeadline = 0
    r._onTick(0.0)
    assert r._SyncObj__raftCurrentTerm == 2 and r._SyncObj__raftState == 0  # follower
    r.leaving = False
    r._SyncObj__raftElectionDeadline = 0
    r._onTick(0.0)
    assert r._SyncObj__raftCurrentTerm == 3 and r._SyncObj__raftState == 1  # candidate


class _Link:
    def __init__(self) -> None:
        self.state = CONNECTION_STATE.CONNECTED


def test_every_silent_link_carries_a_keepalive_each_second(
        follower: Follower, monkeypatch: pytest.MonkeyPatch) -> None:
    # pysyncobj closes a link on which nothing was read for connectionTimeout, at its
    # next message, and loses that message: two followers never talk while a leader
    # leads, so a candidate's vote request reached only the old leader.
    transport = follower.replica._SyncObj__transport
    monkeypatch.setattr(TCPTransport, "_onTick", lambda self: None)
    up, down = object(), _Link()
    down.state = CONNECTION_STATE.DISCONNECTED
    transport._connections = {up: _Link(), down: down}
    sent: list[tuple[object, dict[str, Any]]] = []

    def record(self: TCPTransport, node: object, msg: dict[str, Any]) -> bool:
        sent.append((node, msg))
        return True

    monkeypatch.setattr(TCPTransport, "send", record)
    monkeypatch.delattr(transport, "send")  # (the fixture's; GuardedTransport.send now)

    def look() -> None:  # (the next look at the links is due)
        transport._keepalive_at = monotonic() - 0.01
        transport._onTick()

    transport._onTick()
    transport._onTick()  # (before the next look: nothing more)
    assert sent == [(up, KEEPALIVE_MESSAGE)]
    look()  # (a keepalive went less than KEEPALIVE ago: none)
    assert sent == [(up, KEEPALIVE_MESSAGE)]
    transport._sent_at[up] = monotonic() - KEEPALIVE
    look()
    assert sent == [(up, KEEPALIVE_MESSAGE)] * 2
    # A link that carries other messages (a leader's appends) needs no keepalive
    transport._sent_at[up] = monotonic() - KEEPALIVE
    transport.send(up, {"type": "append_entries"})
    look()
    assert sent == [(up, KEEPALIVE_MESSAGE)] * 2 + [(up, {"type": "append_entries"})]
    # ...and a member that receives one changes nothing and answers nothing
    follower.load([1, 2], commit=3, term=2)
    before = list(sent)
    follower.replica._SyncObj__onMessageReceived(follower.leader, dict(KEEPALIVE_MESSAGE))
    assert sent == before and follower.replica._SyncObj__raftCurrentTerm == 2
