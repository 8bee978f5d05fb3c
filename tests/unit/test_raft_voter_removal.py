"""The leader removes a voter only when membership takes it for dead and the leader has
not heard from it itself. Membership takes news from other members: in a partition that a
member bridges, one side's verdict reached the other, and a leader removed a voter on its
own side that still answered its appends; the two voters left, one on each side, made no
majority until the heal (the partition nemesis, seed 5710). Another leader removed a voter
it heard from and, itself wiped 1.5 s later, left a group that could elect no leader
(seed 5709)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from objcache.cluster.membership import DEAD
from objcache.cluster.raftgroup import RaftGroup
from tests.helpers.fake_membership import FakeMembership


class Leader:
    """The part of a leading RaftNode that `_manage_voters` uses."""

    def __init__(self, voters: list[str], heard: set[str]) -> None:
        self.voters = voters
        self.heard = heard
        self.removed: list[str] = []

    def members(self) -> list[str]:
        return sorted(self.voters)

    def heard_from(self, addr: str) -> bool:
        return addr in self.heard

    async def remove_member(self, addr: str, timeout: float) -> None:
        self.removed.append(addr)
        self.voters.remove(addr)


class Client:
    async def call(self, node: str, msg: dict[str, Any], **kw: Any) -> Any:
        return {"ok": True}, None


async def _round(tmp_path: Path, heard: set[str]) -> Leader:
    ms = FakeMembership("n0", others={"n1": "r1", "n2": "r2", "n3": "r3"})
    ms.members["n1"].state = DEAD  # (news from another member)
    ms.members["n3"].raft_n = 3  # a learner that follows the group: it could take the place
    g: RaftGroup[Any] = RaftGroup(ms, Client(), None, "r0",  # type: ignore[arg-type]
                                  tmp_path / "g", "k" * 32, dict, lambda m, c: None,
                                  max_voters=3)
    leader = Leader(["r0", "r1", "r2"], heard)
    async with trio.open_nursery() as nursery:
        g._nursery = nursery
        await g._manage_voters(leader)  # type: ignore[arg-type]
    return leader


async def test_a_voter_the_leader_hears_from_is_not_removed(tmp_path: Path) -> None:
    leader = await _round(tmp_path, heard={"r1", "r2"})
    assert leader.removed == [] and leader.voters == ["r0", "r1", "r2"]


async def test_a_voter_dead_and_silent_is_removed(tmp_path: Path) -> None:
    leader = await _round(tmp_path, heard={"r2"})
    assert leader.removed == ["r1"]
