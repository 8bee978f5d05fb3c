"""A learner's own command comes back with the log up to it: the voter's answer to
`raft_submit` carries the entries the learner lacks, so the learner applies them at once
instead of asking its feed to hurry and waiting for that answer as well. Write-back's
commands (background) leave a learner lazy. A learner's read barrier gets the same from
the leader's answer to `raft_read_index`. One real voter in this process; the learner's
peer calls go straight to the voter's handlers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from objcache.cluster.learner import Learner
from objcache.cluster.raftgroup import RaftGroup
from objcache.cluster.readindex import ReadIndex
from objcache.raft.node import RaftNode
from tests.helpers.cluster import free_port
from tests.helpers.fake_membership import FakeMembership
from tests.helpers.raftlog import Log, submit_once_led


class Routed:
    """A PeerClient whose calls are answered by the voter's handlers; it records them."""

    def __init__(self, g: RaftGroup[Any]) -> None:
        self.g = g
        self.ops: list[str] = []

    async def call(self, node: str, msg: dict[str, Any], max_data: int, timeout: float
                   ) -> tuple[dict[str, Any], Any]:
        self.ops.append(msg["op"])
        handler = {"raft_submit": self.g._submit, "raft_feed": self.g._feed,
                   "raft_feed_now": self.g._feed_now,
                   "raft_read_index": self.g.reads._serve}[msg["op"]]
        return await handler("n1", msg)


def _voter(tmp_path: Path) -> tuple[str, RaftNode, RaftGroup[Any], Routed]:
    """A real voter, alone in its group, with the handlers a learner's calls go to."""
    addr = f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [addr], tmp_path / "m0", "k" * 32, Log())
    g: RaftGroup[Any] = RaftGroup(FakeMembership("n1", others={"n0": addr}), None, None, addr,  # type: ignore[arg-type]
                                  tmp_path / "g", "k" * 32, dict, lambda m, c: None)
    g._current = node
    g._token = trio.lowlevel.current_trio_token()
    node.feed.on_add = g._wake_feed
    return addr, node, g, Routed(g)


async def test_a_learners_command_comes_back_with_the_log_up_to_it(tmp_path: Path) -> None:
    addr, node, g, client = _voter(tmp_path)
    waits: list[tuple[int, bool]] = []
    progress: list[int] = []

    async def wait_applied(index: int, deadline: float, active: bool) -> None:
        waits.append((index, active))
        if learner.applied < index:
            raise AssertionError(f"entry {index} was not applied when submit returned")

    learner = Learner(client, FakeMembership("n1", others={"n0": addr}), Log(), [addr],  # type: ignore[arg-type]
                      g.group, lambda m, c, i: None, wait_applied, progress.append)
    try:
        await submit_once_led(node, "before", 20)
        await learner._take(*await g._feed("n1", {"after": 0, "wait": 1.0}))  # a snapshot
        assert learner.snapshots == 1 and learner.state.seen == ["before"]
        client.ops.clear()
        # Entries the learner has not seen yet (its feed is not running)...
        await node.submit({"name": "other"}, timeout=5)

        # ...come with the answer to its own command, in order, and are applied.
        assert await learner.submit({"name": "mine"}, timeout=5) == {"ok": True}
        assert learner.state.seen == ["before", "other", "mine"]
        assert client.ops == ["raft_submit"]  # no feed request, no hurry
        assert progress[-1] == learner.applied == node.applied_index()
        assert waits == [(learner.applied, True)]  # a user's command: the learner is active

        # Write-back's commands do not make a learner active (it keeps lingering).
        await learner.submit({"name": "claim"}, timeout=5, background=True)
        assert waits[-1] == (learner.applied, False)
        assert learner.state.seen[-1] == "claim"

        # An entry already applied (a feed answer brought it first) is not applied again.
        await node.submit({"name": "fed"}, timeout=5)
        _, data = await g._feed("n1", {"after": learner.applied, "wait": 1.0})
        assert await learner._apply(data)
        await learner.submit({"name": "last"}, timeout=5)
        assert learner.state.seen[-3:] == ["claim", "fed", "last"]
    finally:
        node.destroy()


async def test_a_learners_read_barrier_comes_back_with_the_log_up_to_it(tmp_path: Path
                                                                         ) -> None:
    addr, node, g, client = _voter(tmp_path)

    async def wait_applied(index: int, deadline: float, active: bool) -> None:
        if learner.applied < index:
            raise AssertionError(f"entry {index} was not applied when the answer came")

    learner = Learner(client, FakeMembership("n1", others={"n0": addr}), Log(), [addr],  # type: ignore[arg-type]
                      g.group, lambda m, c, i: None, wait_applied, lambda i: None)
    reader = ReadIndex(FakeMembership("n1", others={"n0": addr}), client, lambda: learner,  # type: ignore[arg-type]
                       lambda: g.group, wait_applied)
    try:
        await submit_once_led(node, "before", 20)
        await learner._take(*await g._feed("n1", {"after": 0, "wait": 1.0}))  # a snapshot
        assert learner.leader == addr and learner.state.seen == ["before"]
        # (a new leader answers once it has committed an entry in its term after the
        # first question: tests/unit/test_read_index.py)
        await g.reads._serve("n1", {"group": g.group})
        await node.submit({"name": "other"}, timeout=5)
        await node.submit({"name": "more"}, timeout=5)
        client.ops.clear()

        assert await reader.barrier(5.0)
        assert learner.state.seen == ["before", "other", "more"]
        assert learner.applied == node.applied_index()
        assert client.ops == ["raft_read_index"]  # no feed request, no hurry

        # Nothing to bring: the answer is the index alone.
        assert await reader.barrier(5.0)
        assert learner.state.seen == ["before", "other", "more"]
    finally:
        node.destroy()
