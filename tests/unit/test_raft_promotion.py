"""A promotion the group takes back: a voter restarted with its journal finds itself
named among the voters and starts its voter at once, while the leader, which had taken
it for dead, removes it. The promotion used to wait out PROMOTE_WAIT (120 s), the node
saying "promoting" all along (the partition nemesis, 7 nodes, seed 5004: the cluster
did not settle). Now it ends once the voters it had been counted among leave it out, or
once they fill up without it (seed 5103)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import trio

from objcache.cluster.raftgroup import RaftGroup

ME = "10.0.0.3:7001"


class Learner:
    def __init__(self, voters: list[str]) -> None:
        self.voters = voters
        self.stopped = False

    async def submit(self, cmd: dict[str, Any], timeout: float) -> None:
        pass

    def stop(self) -> None:
        self.stopped = True


class Voter:
    """A new voter that never gets to vote (its leader no longer sends it anything)."""

    voting = False

    def __init__(self) -> None:
        self.destroyed = False

    def status(self) -> dict[str, Any]:
        return {"leader": "10.0.0.2:7001"}

    def applied_index(self) -> int:
        return 0

    def destroy(self) -> None:
        self.destroyed = True


def _promoting(tmp_path: Path, voters: list[str]) -> tuple[RaftGroup, Learner, Voter]:
    g = object.__new__(RaftGroup)  # (only what _hand_over touches)
    learner, voter = Learner(voters), Voter()
    g.addr, g.dir, g.learner = ME, tmp_path / "raft", learner  # type: ignore[assignment]
    g._deliver_lock = threading.Lock()
    g._held = []
    g._promoting, g._promoting_tag = voter, object()  # type: ignore[assignment]
    g.max_voters = 3
    return g, learner, voter


async def _hand_over_until_voters_become(g: RaftGroup, learner: Learner, voter: Voter,
                                         later: list[str]) -> None:
    """`_hand_over` while the learner's view of the voters changes to `later` after
    0.3 s; it must end by itself within 5 s."""

    async def change() -> None:
        await trio.sleep(0.3)
        learner.voters = later

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(change)
            await g._hand_over(voter, g._promoting_tag)  # type: ignore[arg-type]


async def test_a_promotion_ends_when_the_group_removes_this_node(tmp_path: Path) -> None:
    g, learner, voter = _promoting(tmp_path, ["10.0.0.1:7001", "10.0.0.2:7001", ME])
    await _hand_over_until_voters_become(
        g, learner, voter, ["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.4:7001"])
    assert voter.destroyed and g._promoting is None and not learner.stopped


async def test_a_promotion_not_counted_yet_goes_on(tmp_path: Path) -> None:
    """A learner the leader asked to become a voter is added to the voters just after:
    not being among them yet does not end its promotion."""
    g, learner, voter = _promoting(tmp_path, ["10.0.0.1:7001", "10.0.0.2:7001"])
    with trio.move_on_after(0.5):
        await g._hand_over(voter, g._promoting_tag)  # type: ignore[arg-type]
    assert not voter.destroyed and g._promoting is voter


async def test_a_promotion_ends_when_the_voters_fill_up_without_this_node(
        tmp_path: Path) -> None:
    """The leader's request to promote us gave up while we were cut off, promoted another
    learner, and still reached us once the cut healed (seed 5103: "promoting" for 120 s,
    and the cluster did not settle). A full set of voters without us, different from the
    one we saw when the promotion began, ends it. The same full set seen from the start
    does not: our view may not show yet the removal that made the place."""
    g, learner, voter = _promoting(tmp_path, ["10.0.0.1:7001", "10.0.0.2:7001",
                                              "10.0.0.5:7001"])
    with trio.move_on_after(0.5):
        await g._hand_over(voter, g._promoting_tag)  # type: ignore[arg-type]
    assert not voter.destroyed and g._promoting is voter

    g, learner, voter = _promoting(tmp_path, ["10.0.0.1:7001", "10.0.0.2:7001"])
    await _hand_over_until_voters_become(
        g, learner, voter, ["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.4:7001"])
    assert voter.destroyed and g._promoting is None and not learner.stopped
