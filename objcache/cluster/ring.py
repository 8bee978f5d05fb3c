"""Chunk placement: which node owns a chunk, on a consistent-hash ring (uhashring).

A chunk (object key, ETag, chunk index) hashes to a point on the ring; its owner is the
node whose virtual node follows that point. Each node gets virtual nodes in proportion to
its cache capacity, so a node with twice the NVMe holds about twice the chunks. Points are
named "<node id>-<n>", so a node's points depend only on its id and weight: adding or
removing a node moves only the chunks in that node's arcs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from uhashring import HashRing

# Virtual nodes of the largest node in the ring; others get a proportional number (at least
# MIN_VNODES). 160 points per node keep shares within a few percent of their weight while
# bounding the ring at 160 points per member, however large the caches are.
MAX_VNODES = 160
MIN_VNODES = 8
HASH_SPACE = 1 << 128  # uhashring's default hash is md5


def chunk_point(key: str, etag: str, idx: int) -> str:
    """The string a chunk hashes as. NUL cannot occur in S3 keys or ETags."""
    return f"{key}\0{etag}\0{idx}"


class Ring:
    """An immutable view of the ring for one set of members.

    `members` maps node id -> capacity in bytes (the weight).
    """

    def __init__(self, members: Mapping[str, int]) -> None:
        self.members = dict(members)
        top = max(self.members.values(), default=1) or 1
        nodes = {node: {"vnodes": max(MIN_VNODES, round(MAX_VNODES * max(cap, 0) / top)),
                        "weight": 1}
                 for node, cap in self.members.items()}
        self._ring = HashRing(nodes=nodes) if nodes else None

    def __len__(self) -> int:
        return len(self.members)

    def owner(self, point: str, skip: Iterable[str] = ()) -> str | None:
        """The first node at or after `point` that is not in `skip` (None if none is left)."""
        if self._ring is None:
            return None
        skip = set(skip)
        if not skip:
            return self._ring.get_node(point)
        for conf in self._ring.range(point):
            if conf["nodename"] not in skip:
                return conf["nodename"]
        return None

    def shares(self) -> dict[str, float]:
        """Each node's fraction of the hash space (what it would own of uniform keys)."""
        if self._ring is None:
            return {}
        points = self._ring.get_points()  # sorted (point, node)
        share = dict.fromkeys(self.members, 0.0)
        prev = points[-1][0] - HASH_SPACE  # the arc that wraps around zero
        for point, node in points:
            share[node] += (point - prev) / HASH_SPACE
            prev = point
        return share
