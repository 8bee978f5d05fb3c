"""A node that fell behind the cluster's log takes a snapshot of the state; what it
shows must follow the new state, although no command brought the changes
(objcache.backend.replicated.replaced_changes; the partition nemesis with learners,
seed 4309: a learner showed unlinked files and missed renamed ones after the heal)."""

from __future__ import annotations

from objcache.backend.replicated import applied_changes, replaced_changes
from objcache.entries import Attrs, FileEntry, NsChange, Tombstone
from objcache.raft.node import STATE_REPLACED
from objcache.txn.state import ClusterState

A = Attrs(0o100644, 0, 0, 1)


def test_every_difference_is_a_change_and_a_vanished_entry_is_asked_for_again() -> None:
    same = FileEntry(A, size=1, cid="c0")
    old = {"same": same, "changed": FileEntry(A, size=1, cid="c1"),
           "uploaded": FileEntry(A, size=2, cid="c2"), "deleted": Tombstone()}
    new = {"same": same, "changed": FileEntry(A, size=3, cid="c3"),
           "created": FileEntry(A, size=4, cid="c4"), "unlinked": Tombstone()}
    got = sorted(replaced_changes(old, new), key=lambda c: c.key)
    assert got == [NsChange("changed", new["changed"]),
                   NsChange("created", new["created"]),
                   NsChange("unlinked", new["unlinked"]),
                   NsChange("uploaded", None, resync=True)]


def test_a_replaced_state_reaches_the_applied_feed() -> None:
    old, new = ClusterState(), ClusterState()
    new.ns.entries["k"] = FileEntry(A, size=1, cid="c")
    got = applied_changes(new, {"op": STATE_REPLACED, "old": old})
    assert got == ([NsChange("k", new.ns.entries["k"])], None)
