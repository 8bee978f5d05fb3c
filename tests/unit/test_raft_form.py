"""Which starting node forms the cluster's Raft group (objcache/cluster/raftgroup.py,
`_enter_group`). A node that joined through a seed that was itself still joining knew no
group, formed one at once, and led a second namespace with the learners that found it
first (tests/integration/test_scale.py, 8 nodes started 4 at a time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from objcache.cluster.membership import ALIVE, Member
from objcache.cluster.raftgroup import FORM_WAIT, RaftGroup
from tests.helpers.fake_membership import FakeMembership


def _group(ms: FakeMembership, tmp_path: Path) -> tuple[RaftGroup[Any], list[str]]:
    g: RaftGroup[Any] = RaftGroup(ms, None, None, ms.me.raft, tmp_path, "k" * 32,  # type: ignore[arg-type]
                                  dict, lambda m, c: None)
    did: list[str] = []

    def voter(partners: list[str]) -> None:
        did.append("formed")

    async def learner(best: Member | None, *a: Any, **k: Any) -> None:
        did.append(f"learner of {best.id if best else None}")

    g._become_voter = voter  # type: ignore[method-assign]
    g._become_learner_of = learner  # type: ignore[method-assign]
    return g, did


async def test_a_node_that_knows_only_a_joining_seed_waits_for_the_group(
        tmp_path: Path, autojump_clock: Any) -> None:
    ms = FakeMembership("n4", raft="n4r")
    ms.members["n5"] = Member("n5", "n5", 1, 1, raft="n5r")  # a seed joining too
    g, did = _group(ms, tmp_path)

    async def gossip() -> None:  # the first node's record arrives a second later
        await trio.sleep(1.0)
        ms.members["n0"] = Member("n0", "n0", 1, 1, raft="n0r", raft_n=1, group="n0/g")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gossip)
        await g._enter_group()
    assert did == ["learner of n0"]


async def test_nodes_starting_from_zero_let_the_lowest_id_form(tmp_path: Path,
                                                               autojump_clock: Any) -> None:
    lowest = FakeMembership("n1", raft="n1r")
    lowest.members["n2"] = Member("n2", "n2", 1, 1, raft="n2r")
    g, did = _group(lowest, tmp_path)
    t0 = trio.current_time()
    await g._enter_group()
    assert did == ["formed"]
    assert trio.current_time() - t0 < FORM_WAIT + 0.5

    other = FakeMembership("n2", raft="n2r")
    other.members["n1"] = Member("n1", "n1", 1, 1, raft="n1r", state=ALIVE)
    g, did = _group(other, tmp_path / "2")

    async def formed() -> None:
        await trio.sleep(FORM_WAIT + 0.5)
        other.members["n1"].raft_n, other.members["n1"].group = 1, "n1/g"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(formed)
        await g._enter_group()
    assert did == ["learner of n1"]


async def test_a_first_node_forms_at_once(tmp_path: Path, autojump_clock: Any) -> None:
    g, did = _group(FakeMembership("n0", raft="n0r"), tmp_path)
    t0 = trio.current_time()
    await g._enter_group()
    assert did == ["formed"] and trio.current_time() == t0
