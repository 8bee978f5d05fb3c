"""`objcache status`'s partition view (objcache/status.py `partition`): cut off from the
majority, it names every member it cannot reach, also one membership had only heard of
when the cut came (and has forgotten since)."""

from __future__ import annotations

from objcache.status import partition

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
