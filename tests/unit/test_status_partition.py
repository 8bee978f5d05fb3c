"""`objcache status`'s partition view (objcache/status.py, `partition`): a voter needs
half of the other voters with its own vote; a learner, which has no vote, needs a majority
of the voters (it reached 2 of 5 and was shown as connected). Cut off, it names every
member it cannot reach, also one membership had only heard of when the cut came (and has
forgotten since)."""

from __future__ import annotations

from typing import Any

from objcache.status import partition

VOTERS = [f"10.0.0.{i}:2" for i in range(1, 6)]


def _members(me: str, states: dict[str, str]) -> list[dict[str, Any]]:
    return [{"id": me, "state": "self", "last_seen_seconds": 0.0}] + [
        {"id": k, "state": v, "last_seen_seconds": 1.0 if v == "alive" else 30.0}
        for k, v in states.items()]


def test_a_voter_with_two_of_four_others_has_a_majority() -> None:
    raft = {"members": VOTERS, "self": VOTERS[0], "connected": VOTERS[1:3]}
    got = partition("n1", _members("n1", {"n2": "alive", "n3": "alive"}), raft)
    assert not got["cut_off"]
    assert got["raft_unreachable"] == VOTERS[3:]


def test_a_learner_reaching_two_of_five_voters_is_cut_off() -> None:
    raft = {"members": VOTERS, "self": "10.0.0.9:2", "connected": VOTERS[:2]}
    members = _members("n9", {"n1": "alive", "n2": "alive", "n3": "dead", "n4": "dead",
                              "n5": "dead"})
    got = partition("n9", members, raft)
    assert got["cut_off"]
    assert got["raft_unreachable"] == VOTERS[2:]
    assert got["cut_off_seconds"] == 30.0  # when the third of five voters went silent


def test_a_learner_reaching_three_of_five_voters_is_not_cut_off() -> None:
    raft = {"members": VOTERS, "self": "10.0.0.9:2", "connected": VOTERS[:3]}
    assert not partition("n9", _members("n9", {}), raft)["cut_off"]

RAFT = {"members": ["r0", "r1", "r2"], "self": "r0", "connected": []}


def test_a_recorded_member_membership_never_reached_is_named_when_cut_off() -> None:
    members = [{"id": "n0", "state": "alive", "last_seen_seconds": 0.0},
               {"id": "n1", "state": "dead", "last_seen_seconds": 16.2}]
    pt = partition("n0", members, RAFT, recorded=["n0", "n1", "n2"])
    assert pt["cut_off"]
    assert [u["id"] for u in pt["unreachable"]] == ["n1", "n2"]
    assert pt["unreachable"][1]["state"] == "not reached"


def test_a_node_of_the_majority_lists_only_what_membership_says() -> None:
    members = [{"id": "n0", "state": "alive", "last_seen_seconds": 0.0},
               {"id": "n1", "state": "alive", "last_seen_seconds": 0.2}]
    raft = dict(RAFT, connected=["r1", "r2"])
    pt = partition("n0", members, raft, recorded=["n0", "n1", "n2"])
    assert not pt["cut_off"] and pt["unreachable"] == []
