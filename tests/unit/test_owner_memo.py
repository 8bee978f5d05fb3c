"""A key's write-back owner is remembered while the ring and the suspects stay the same
(the write-back loop asks for every dirty key twice a second on every node), and asked
again once either changes."""

from __future__ import annotations

from objcache.cluster.ring import Ring
from objcache.txn.coordinator import TxnClient, key_point


class FakeMembership:
    def __init__(self, members: list[str]) -> None:
        self.ring = Ring({m: 1 for m in members})
        self.suspects: set[str] = set()
        self.asked = 0

    def owner(self, point: str) -> str:
        self.asked += 1
        return self.ring.owner(point, self.suspects) or "me"


class FakeNode:
    def __init__(self, ms: FakeMembership) -> None:
        self.node_id = "a"
        self.membership = ms


def test_owners_are_remembered_until_the_ring_or_the_suspects_change() -> None:
    ms = FakeMembership(["a", "b", "c"])
    txn = TxnClient(FakeNode(ms), None, 2, 5.0)  # type: ignore[arg-type]
    keys = [f"d/f{i}" for i in range(50)]
    first = {k: txn.owner(k) for k in keys}
    assert ms.asked == 50 and {txn.owner(k) for k in keys} <= {"a", "b", "c"}
    assert ms.asked == 50  # the second round is remembered

    # A suspect: the keys it owned move, and every key is asked again.
    gone = first[keys[0]]
    ms.suspects.add(gone)
    moved = {k: txn.owner(k) for k in keys}
    assert ms.asked == 100
    assert all(moved[k] != gone for k in keys)
    assert all(moved[k] == first[k] for k in keys if first[k] != gone)

    # A new ring (a member joined): asked again, and the answers are the new ring's.
    ms.ring = Ring({m: 1 for m in ["a", "b", "c", "d"]})
    ms.suspects.clear()
    again = {k: txn.owner(k) for k in keys}
    assert ms.asked == 150
    fresh = FakeMembership(["a", "b", "c", "d"])
    assert again == {k: fresh.owner(key_point(k)) for k in keys}
