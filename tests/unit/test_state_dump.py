"""The replicated state as Raft dumps it (log compaction) and learners take it (snapshots):
compressed once by the state itself, so pysyncobj's gzip has little left to do on its
thread, and a dump written before that change still loads."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import msgpack

from objcache.txn.state import ClusterState
from tests.unit.test_namespace import f, run


def _state(files: int) -> ClusterState:
    st, n = ClusterState(), [0]
    for i in range(files):
        assert run(st, n, op="ns.create", key=f"d/f{i}", e=f())["ok"]
        assert run(st, n, op="ns.commit", key=f"d/f{i}", e=f(size=i, cid=f"c{i}"))["ok"]
    return st


def test_a_dump_is_one_compressed_stream_and_loads_the_same_state() -> None:
    st = _state(300)
    form = st.__getstate__()
    assert set(form) == {"z"} and isinstance(form["z"], bytes)
    # (what is left for pysyncobj's gzip at level 9: a few KiB, not the whole pickle)
    assert len(form["z"]) < len(pickle.dumps(st.__dict__ | {"lock": None}, 5)) / 3
    back = pickle.loads(pickle.dumps(st))
    assert back.digest() == st.digest()
    # remembered transactions come back too: a retry answers as the first time did
    assert run(back, [0], op="ns.create", key="d/f0", e=f()) == \
        run(st, [0], op="ns.create", key="d/f0", e=f())


def test_a_retry_answers_what_the_first_application_answered() -> None:
    st = ClusterState()
    first = st.apply({"tx": "a", "op": "ns.create", "key": "x", "e": f()})
    again = st.apply({"tx": "a", "op": "ns.create", "key": "x", "e": f()})
    assert first == again == {"ok": True, "ver": 1}
    assert st.apply({"tx": "b", "op": "fence", "txs": ["a", "c"]}) == \
        {"applied": {"a": first}, "fenced": ["c"]}


def test_a_dump_written_before_compression_still_loads() -> None:
    st = _state(20)
    old = dict(st.__dict__)
    del old["lock"]
    # (then results were kept as they were, not packed)
    old["_tx"] = OrderedDict((t, msgpack.unpackb(r)) for t, r in st._tx.items())
    back = ClusterState.__new__(ClusterState)
    back.__setstate__(old)
    assert back.digest() == st.digest()
    assert back.apply({"tx": "t1", "op": "noop"}) == st.apply({"tx": "t1", "op": "noop"})
