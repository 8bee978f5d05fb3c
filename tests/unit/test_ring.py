"""Placement on the consistent-hash ring: balance, weights, minimal movement, routing
around a node."""

from __future__ import annotations

from collections import Counter

from objcache.cluster.ring import Ring, chunk_point

GIB = 1 << 30
POINTS = [chunk_point(f"data/file{i // 64}", "etag", i % 64) for i in range(20000)]


def _counts(ring: Ring) -> Counter[str]:
    return Counter(ring.owner(p) for p in POINTS)


def test_equal_nodes_get_equal_shares() -> None:
    ring = Ring({"a": 10 * GIB, "b": 10 * GIB, "c": 10 * GIB})
    counts = _counts(ring)
    shares = ring.shares()
    assert abs(sum(shares.values()) - 1) < 1e-9
    for node in "abc":
        assert 0.26 < counts[node] / len(POINTS) < 0.40, counts
        # The computed hash-space share predicts what the node really gets.
        assert abs(shares[node] - counts[node] / len(POINTS)) < 0.03


def test_bigger_cache_gets_proportionally_more() -> None:
    counts = _counts(Ring({"small": 100 * GIB, "big": 300 * GIB}))
    assert 2.3 < counts["big"] / counts["small"] < 3.9, counts


def test_a_join_moves_only_the_new_nodes_share() -> None:
    before = Ring({"a": GIB, "b": GIB, "c": GIB})
    after = Ring({"a": GIB, "b": GIB, "c": GIB, "d": GIB})
    moved = [p for p in POINTS if before.owner(p) != after.owner(p)]
    assert all(after.owner(p) == "d" for p in moved)
    assert 0.17 < len(moved) / len(POINTS) < 0.33


def test_skipping_a_node_routes_to_its_successor() -> None:
    full = Ring({"a": GIB, "b": GIB, "c": GIB})
    without_c = Ring({"a": GIB, "b": GIB})
    assert all(full.owner(p, skip={"c"}) == without_c.owner(p) for p in POINTS[:2000])
    assert full.owner(POINTS[0], skip={"a", "b", "c"}) is None
    assert Ring({}).owner(POINTS[0]) is None
