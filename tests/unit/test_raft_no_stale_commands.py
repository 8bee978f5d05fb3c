"""A command that failed for want of a leader is in no log and never applies later: with
pysyncobj's commandsWaitLeader it stayed queued on the member, with no deadline, and was
sent to the first leader there was (a close that had answered EIO took effect when the
network healed). Three real members in this process, on loopback."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import trio

from objcache.errors import NoQuorum
from objcache.raft.node import LEADER_SILENT, LEADERLESS_BATCH, STOP_POLL, RaftNode
from tests.helpers.cluster import free_port
from tests.helpers.raftlog import Log, submit_once_led


async def test_a_command_without_a_leader_never_applies_later(tmp_path: Path) -> None:
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    made: list[RaftNode] = []

    def member(i: int) -> RaftNode:
        node = RaftNode(addrs[i], addrs, tmp_path / f"m{i}", "k" * 32, Log())
        made.append(node)
        return node

    try:
        alone = member(0)  # its partners are not running: no leader
        with pytest.raises(NoQuorum) as e:
            await alone.submit({"name": "early"}, timeout=1.0)
        assert not e.value.maybe_sent
        member(1)
        member(2)
        await submit_once_led(alone, "later", 30)
        await trio.sleep(1.0)  # (a queued command would be sent with the first ones)
        for node in made:
            assert "early" not in node.state.seen, node.state.seen
    finally:
        for node in made:
            node.destroy()


async def test_a_feed_header_says_what_the_full_status_says(tmp_path: Path) -> None:
    """A voter answers each of its learners with a header read from pysyncobj's fields
    directly (a full status rebuilds every partner's indexes): the same leader, term,
    commit index and members."""
    addr = f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [addr], tmp_path / "m0", "k" * 32, Log())
    try:
        await submit_once_led(node, "one", 20)
        h, st = node.feed_header(), node.status()
        assert h.voters == node.members() == [addr]
        assert (h.leader, h.term, h.commit) == (st["leader"], st["term"], st["commit_index"])
        assert h.leader == addr and h.term >= 1 and h.commit >= 2
    finally:
        node.destroy()


async def test_a_call_waiting_on_a_member_that_stops_fails_at_once(tmp_path: Path) -> None:
    """A voter the group removed is stopped (it becomes a learner); a command waiting on
    it for an answer fails then, not at its timeout, and its caller sends it again
    through the learner. (It waited its whole 5 s and failed a flush: the partition
    nemesis with learners, seed 4303.)"""
    addr = f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [addr], tmp_path / "m0", "k" * 32, Log())
    try:
        await submit_once_led(node, "one", 20)
        node._replica._apply = lambda blob, callback: None  # never answered
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, lambda: (time.sleep(0.3),
                                                                 node.destroy()))
            t0 = trio.current_time()
            with pytest.raises(NoQuorum) as e:
                await node.submit({"name": "two"}, timeout=10.0)
        assert trio.current_time() - t0 < 2.0 and "stopped" in str(e.value)
        assert e.value.maybe_sent  # (it may have reached a leader: its caller settles it)
    finally:
        node.destroy()


async def test_a_batch_waits_for_a_leader_about_an_election_then_fails(tmp_path: Path
                                                                     ) -> None:
    """A voter with no leader fails a batch after LEADERLESS_BATCH, not at its timeout: a
    learner's commands sent to a voter cut off from the leader then go to another voter
    in time (seed 5926: the close waited its whole 5 s on the one voter without a leader,
    and answered EIO while the other voters committed)."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    alone = RaftNode(addrs[0], addrs, tmp_path / "m0", "k" * 32, Log())
    try:
        t0 = time.monotonic()
        with pytest.raises(NoQuorum) as e:
            await alone.submit({"name": "x"}, timeout=10.0)
        took = time.monotonic() - t0
        assert not e.value.maybe_sent
        assert LEADERLESS_BATCH - 0.1 <= took < LEADERLESS_BATCH + 1.0, took
    finally:
        alone.destroy()


@pytest.mark.parametrize("role", ["leader", "follower"])
async def test_a_command_whose_leader_is_gone_fails_then(tmp_path: Path, role: str) -> None:
    """A member that hears nothing more from the others (its packets dropped: the links
    look connected) gives up a command waiting for a leader that is gone, as maybe in
    the log, so that it is sent again (by its transaction id) through a member that
    reaches a leader: a leader once no majority answered it for LEADER_SILENT (pysyncobj
    steps it down only at 3.5 s, and answers its uncommitted commands only when entries
    at their indexes are applied, after the heal); a follower connected to nobody
    (pysyncobj keeps its leader) once that leader has been silent for LEADER_SILENT.
    Each waited its whole timeout holding one of the voter's two batches in flight; a
    learner's close queued behind two of them answered EIO while every node was
    reachable (partition seed 5968: a leader cut off by a bridged partition)."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    made = [RaftNode(a, addrs, tmp_path / f"m{i}", "k" * 32, Log())
            for i, a in enumerate(addrs)]
    try:
        await submit_once_led(made[0], "one", 30)
        leader = made[0].status()["leader"]
        deaf = next(n for n in made if (n.addr == leader) == (role == "leader"))
        r = deaf._replica
        r._SyncObj__transport._onMessageReceivedCallback = lambda node, message: None
        if role == "follower":
            r._SyncObj__connectedToAnyone = lambda: False  # (so never a candidate)
        t0 = time.monotonic()
        with pytest.raises(NoQuorum) as e:
            await deaf.submit({"name": "two"}, timeout=8.0)
        took = time.monotonic() - t0
        assert e.value.maybe_sent and "leader was gone" in str(e.value), e.value
        assert took < LEADER_SILENT + STOP_POLL + 2.0, took  # (at its timeout: 10 s)
    finally:
        for node in made:
            node.destroy()


async def test_leading_and_stepping_down_are_logged(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Which member led when is read from the logs after a partition campaign's failure
    (seed 5968's leader could only be inferred)."""
    addr = f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [addr], tmp_path / "m0", "k" * 32, Log())
    try:
        with caplog.at_level(logging.INFO, logger="objcache.raft.node"):
            await submit_once_led(node, "one", 20)
            node._role_changed(2, 1)  # (as pysyncobj calls it when a leader stands again)
        said = [r.getMessage() for r in caplog.records if r.name == "objcache.raft.node"]
        assert f"raft: leading, term {node.term()}" in said
        assert f"raft: no longer leading (now candidate), term {node.term()}" in said
    finally:
        node.destroy()
