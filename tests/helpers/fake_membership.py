"""The part of objcache.cluster.membership.Membership that a RaftGroup, a Learner or a
ReadIndex reads in in-process unit tests: this node's Member, the others by id, and the
suspects (none unless a test adds them)."""

from __future__ import annotations

from objcache.cluster.membership import Member


def member(node: str, raft: str) -> Member:
    return Member(node, node, 1, 1, raft=raft)


class FakeMembership:
    """`me` with Raft address `raft` (r<number> of n<number> by default); `others`: the
    other members' Raft addresses by node id."""

    def __init__(self, me: str = "n0", raft: str | None = None,
                 others: dict[str, str] | None = None) -> None:
        self.me = member(me, raft if raft is not None else "r" + me.removeprefix("n"))
        self.members = {n: member(n, r) for n, r in (others or {}).items()}
        self.suspects: set[str] = set()


def numbered(count: int) -> dict[str, str]:
    """n0..n<count-1>, at Raft addresses r0..r<count-1>."""
    return {f"n{i}": f"r{i}" for i in range(count)}
