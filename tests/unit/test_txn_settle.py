"""What a change that could not commit in time answers (TxnClient.submit): nothing sent
anywhere is EIO at once; one that may be in a leader's log is settled by a fence before
the call answers: its result if it was applied (a lost reply), EIO if the fence made the
log refuse it; ETIMEDOUT (InDoubt) if the fence could not commit either, and the fence is
retried until it does (`settle_loop`)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from objcache.errors import InDoubt, NoQuorum
from objcache.txn.coordinator import TxnClient
from objcache.txn.state import ClusterState


class Raft:
    """A Raft member over a real ClusterState whose answers a test scripts: `lose` the
    reply of commands that are applied anyway, `hold` commands without applying them
    (they may be applied later: `deliver`), or be cut off (`reachable` False)."""

    def __init__(self) -> None:
        self.state = ClusterState()
        self.reachable = True
        self.lose: set[str] = set()  # ops whose reply is lost after they are applied
        self.hold: set[str] = set()  # ops that reach a log but do not commit
        self.held: list[dict[str, Any]] = []

    async def submit(self, cmd: dict[str, Any], timeout: float = 10.0,
                     background: bool = False) -> Any:
        if not self.reachable:
            e = NoQuorum("raft command failed: missing leader")
            e.maybe_sent = False
            raise e
        if cmd["op"] in self.hold:
            self.held.append(cmd)
            await trio.sleep(min(timeout, 0.05))
            raise NoQuorum("raft command got no answer")
        result = self.state.apply(cmd)
        if cmd["op"] in self.lose:
            raise NoQuorum("raft command failed: leader changed")
        return result

    def deliver(self, op: str) -> list[Any]:
        """Apply the held copies of `op` now (what reached a log commits late)."""
        return [self.state.apply(c) for c in self.held if c["op"] == op]


class Group:
    def __init__(self, raft: Raft) -> None:
        self.raft = raft
        self.state = raft.state


class Node:
    def __init__(self) -> None:
        self.node_id = "a"
        self.raft = Group(Raft())


def client(node: Node) -> TxnClient:
    return TxnClient(node, None, 2, 0.3)  # type: ignore[arg-type]


CREATE = {"op": "ns.create", "key": "x", "e": {"mode": 0o100644, "uid": 1, "gid": 1,
                                              "mtime": 5, "size": 0}}


async def test_nothing_sent_is_eio_without_a_fence() -> None:
    node = Node()
    node.raft.raft.reachable = False
    with pytest.raises(NoQuorum) as e:
        await client(node).submit(CREATE)
    assert not isinstance(e.value, InDoubt) and "no leader reachable" in str(e.value)


async def test_a_lost_reply_is_settled_as_committed() -> None:
    node = Node()
    node.raft.raft.lose = {"ns.create"}
    got = await client(node).submit(CREATE)
    assert got["ok"] and node.raft.state.ns.get("x") is not None


async def test_a_held_command_is_fenced_and_never_applies() -> None:
    node = Node()
    raft = node.raft.raft
    raft.hold = {"ns.create"}
    with pytest.raises(NoQuorum, match="fenced") as e:
        await client(node).submit(CREATE)
    assert not isinstance(e.value, InDoubt)
    # The copies that were in a log commit later (the network healed): refused.
    late = raft.deliver("ns.create")
    assert late and all(r == {"error": "fenced"} for r in late)
    assert raft.state.ns.get("x") is None


async def test_cut_off_is_in_doubt_then_settled_in_the_background() -> None:
    node = Node()
    raft = node.raft.raft
    raft.hold = {"ns.create", "fence"}
    txn = client(node)
    with pytest.raises(InDoubt):
        await txn.submit(CREATE)
    assert len(txn.in_doubt) == 1
    async with trio.open_nursery() as n:
        n.start_soon(txn.settle_loop)
        raft.hold = set()  # the node rejoins
        with trio.fail_after(5):
            while txn.in_doubt:
                await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert txn.settled == ["ns.create of 'x': did not take effect (fenced)"]
    assert all(r == {"error": "fenced"} for r in raft.deliver("ns.create"))
    assert raft.state.ns.get("x") is None
