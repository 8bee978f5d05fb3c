"""The replicated namespace overlay, driven directly (no Raft): deterministic outcomes,
atomic multi-key changes, exactly-once by transaction id, version-checked cleaning."""

from __future__ import annotations

from typing import Any

from objcache.entries import DirEntry, FileEntry, NsChange, ObjectRef, Tombstone
from objcache.txn.state import ClusterState

ATTRS = {"mode": 0o100644, "uid": 1, "gid": 1, "mtime": 5}


def f(**kw: Any) -> dict[str, Any]:
    return {**ATTRS, "size": 0, "cid": None, "holders": [], "base": None, "target": None,
            **kw}


def run(st: ClusterState, n: list[int], **cmd: Any) -> Any:
    n[0] += 1
    return st.apply({"tx": f"t{n[0]}", **cmd})


def test_create_unlink_and_exclusive_names() -> None:
    st, n = ClusterState(), [0]
    assert run(st, n, op="ns.create", key="a", e=f())["ok"]
    assert run(st, n, op="ns.create", key="a", e=f()) == {"error": "exists"}
    assert run(st, n, op="ns.create", key="a/", e=ATTRS) == {"error": "exists"}
    assert run(st, n, op="ns.create", key="d/", e=ATTRS)["ok"]
    assert run(st, n, op="ns.create", key="d", e=f(), excl=False) == {"error": "isdir"}
    assert run(st, n, op="ns.create", key="d/x", e=f())["ok"]
    assert run(st, n, op="ns.rmdir", key="d/") == {"error": "notempty"}
    assert run(st, n, op="ns.unlink", key="d/x")["ok"]
    assert run(st, n, op="ns.rmdir", key="d/")["ok"]
    assert st.ns.get("d/") is None
    # An S3 object that is unlinked leaves a tombstone until write-back deletes it.
    assert run(st, n, op="ns.unlink", key="s3only", s3=True)["ok"]
    assert isinstance(st.ns.get("s3only"), Tombstone)
    # A file unlinked elsewhere while open here does not come back at close.
    assert run(st, n, op="ns.commit", key="a", e=f(size=3, cid="c1"), must_exist=True)["ok"]
    assert run(st, n, op="ns.unlink", key="a")["ok"]
    assert run(st, n, op="ns.commit", key="a", e=f(cid="c2"), must_exist=True) == \
        {"error": "gone"}
    assert run(st, n, op="ns.commit", key="s3only", e=f(cid="c3")) == {"error": "gone"}


def test_directory_rename_moves_everything_at_once() -> None:
    st, n = ClusterState(), [0]
    run(st, n, op="ns.create", key="src/new", e=f(cid="c1", size=4))
    objects = [["src/", "e0", 0, 0o40755, 0, 0, 1], ["src/old1", "e1", 10, 0o100600, 2, 2, 3],
               ["src/sub/old2", "e2", 20, 0o100644, 0, 0, 4]]
    r = run(st, n, op="ns.rename", src="src", dst="dst", dir=True, objects=objects,
            e=ATTRS)
    assert r["ok"]
    live = {k: type(e) for k, e in st.ns.entries.items()}
    assert live == {"dst/new": FileEntry, "dst/": DirEntry, "dst/old1": FileEntry,
                    "dst/sub/old2": FileEntry, "src/": Tombstone, "src/old1": Tombstone,
                    "src/sub/old2": Tombstone}
    moved = st.ns.get("dst/old1")
    assert isinstance(moved, FileEntry) and moved.base == ObjectRef("src/old1", "e1", 10)
    assert moved.attrs.mode == 0o100600
    # The old objects must outlive the copies that read them.
    assert st.ns.referenced("src/old1") and not st.ns.referenced("dst/new")
    # Everything the command changed is reported to the node's caches, the move included.
    assert NsChange("src/", None, moved=True) in st.last_changes


def test_retry_applies_once_and_clean_checks_the_version() -> None:
    st = ClusterState()
    cmd = {"op": "ns.create", "key": "x", "e": f(), "tx": "same"}
    assert st.apply(cmd)["ok"]
    assert st.apply(cmd)["ok"]  # the retry gets the first result, not "exists"
    ver = st.ns.get("x").ver  # type: ignore[union-attr]
    st.apply({"op": "ns.commit", "key": "x", "e": f(cid="c9", size=1), "tx": "w"})
    assert st.apply({"op": "ns.clean", "key": "x", "ver": ver, "tx": "c1"}) == {"ok": False}
    ver2 = st.ns.get("x").ver  # type: ignore[union-attr]
    assert st.apply({"op": "ns.clean", "key": "x", "ver": ver2, "etag": "E",
                     "tx": "c2"}) == {"ok": True}
    assert st.ns.get("x") is None
    # Cleaning tells the nodes which S3 version holds the file now.
    assert st.last_changes == [NsChange("x", None, ObjectRef("x", "E", 1))]


def test_malformed_rename_changes_nothing_and_states_agree() -> None:
    a, b = ClusterState(), ClusterState()
    cmds = [{"op": "ns.create", "key": "p/q", "e": f(), "tx": "1"},
            {"op": "ns.rename", "src": "p", "dst": "r", "dir": True, "e": ATTRS,
             "objects": [["p/z", "e", 1, 0, 0, 0, 0], ["p/bad"]], "tx": "2"},
            {"op": "ns.rename", "src": "p", "dst": "r", "dir": True, "e": ATTRS, "tx": "3"}]
    for c in cmds:
        ra, rb = a.apply(dict(c)), b.apply(dict(c))
        assert ra == rb
    assert "error" in a._recall("2") and a.ns.get("r/q") is not None and a.ns.get("p/q") is None
    assert a.digest() == b.digest()


def test_a_fence_settles_a_transaction_for_good() -> None:
    """`fence` (a submitter that gave up on its transactions): one applied already reports
    its result; one not applied yet is refused when it comes later (a resent or delayed
    copy), and the states of all nodes agree."""
    a, b = ClusterState(), ClusterState()
    for st in (a, b):
        assert st.apply({"tx": "n/1", "op": "ns.create", "key": "x", "e": f()})["ok"]
        got = st.apply({"tx": "n/3", "op": "fence", "txs": ["n/1", "n/2"]})
        assert got["fenced"] == ["n/2"] and got["applied"]["n/1"]["ok"]
        late = st.apply({"tx": "n/2", "op": "ns.commit", "key": "x",
                         "e": f(size=3, cid="c2"), "must_exist": True})
        assert late == {"error": "fenced"}
        e = st.ns.get("x")
        assert isinstance(e, FileEntry) and e.cid is None  # the late commit changed nothing
    assert a.digest() == b.digest()
    assert a.apply({"tx": "n/4", "op": "fence", "txs": "n/2"})["error"].startswith("malformed")


def test_an_unlink_or_rename_while_a_write_back_is_claimed_leaves_a_tombstone() -> None:
    """A file whose write-back holds a claim may be landing in S3 while it is unlinked or
    renamed (the coordinator's HEAD saw no object yet): a tombstone has the object that
    lands deleted. Without it the acknowledged unlink was undone by the upload (the
    partition nemesis: an unlinked file back on every node and in S3)."""
    st, n = ClusterState(), [0]
    for key in ("u", "r"):
        assert run(st, n, op="ns.create", key=key, e=f(size=3, cid="c"))["ok"]
        ver = st.ns.get(key).ver  # type: ignore[union-attr]
        assert run(st, n, op="ns.claim", key=key, node="a", ver=ver, at=1.0, lease=80.0)["ok"]
    assert run(st, n, op="ns.unlink", key="u", s3=False)["ok"]
    assert isinstance(st.ns.get("u"), Tombstone)
    assert run(st, n, op="ns.rename", src="r", dst="r2", dir=False, objects=[],
               e=None)["ok"]
    assert isinstance(st.ns.get("r"), Tombstone)
    assert isinstance(st.ns.get("r2"), FileEntry)
    # Without a claim nothing is left behind.
    assert run(st, n, op="ns.create", key="v", e=f())["ok"]
    assert run(st, n, op="ns.unlink", key="v", s3=False)["ok"]
    assert st.ns.get("v") is None
