"""A voter the leader removes is told so, even when the leader took it for dead: it may
only have been slow (a voter promoted on a busy node was taken for dead 1 s later and
removed; nobody told it, and it went on as a voter no group counted, serving a stale
register after the heal: the partition nemesis with learners, seed 4306). A member that
left is not asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from objcache.cluster.membership import ALIVE, DEAD, LEFT, Member
from objcache.cluster.raftgroup import RaftGroup
from tests.helpers.fake_membership import FakeMembership


class Client:
    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def call(self, node: str, msg: dict[str, Any], max_data: int = 0,
                   timeout: float = 0.0) -> Any:
        self.asked.append((node, msg["op"]))
        return {"ok": True}, None


class Raft:
    def __init__(self) -> None:
        self.removed: list[str] = []

    async def remove_member(self, addr: str, timeout: float) -> None:
        self.removed.append(addr)


async def test_a_removed_voter_is_told_unless_it_left(tmp_path: Path) -> None:
    client = Client()
    g: RaftGroup[Any] = RaftGroup(FakeMembership(), client, None,  # type: ignore[arg-type]
                                  "r0", tmp_path / "g", "k" * 32, dict, lambda m, c: None)
    raft = Raft()
    async with trio.open_nursery() as nursery:
        g._nursery = nursery
        for name, state in (("n1", DEAD), ("n2", ALIVE), ("n3", LEFT)):
            m = Member(name, name, 1, 1, raft=f"r{name[1]}", state=state)
            await g._remove_voter(raft, m.raft, m)  # type: ignore[arg-type]
    assert raft.removed == ["r1", "r2", "r3"]
    assert sorted(client.asked) == [("n1", "raft_demote"), ("n2", "raft_demote")]
