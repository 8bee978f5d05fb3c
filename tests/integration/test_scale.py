"""Eight daemons on one bucket (issue 28; benchmarks/scale.py measures 3 to 32): at most
--raft-voters vote and the others follow the log as learners; close-to-open holds
between learners; at rest a node's membership traffic does not grow with the cluster
(SWIM probing, not an all-to-all heartbeat); and when the leader is killed, the cluster
commits again within --txn-timeout and promotes a learner to keep five voters."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from objcache import control
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount

N = 8
VOTERS = 5


def _local(m: Mount) -> dict[str, Any]:
    return control.request(str(m.mnt), {"op": "status", "local": True})


def _raft(m: Mount) -> dict[str, Any]:
    return _local(m)["cluster"]["raft"] or {}


def _start(cluster: Cluster, n: int) -> list[Mount]:
    nodes = [cluster.add(start=False) for _ in range(n)]
    nodes[0].start()
    for i in range(1, n, 4):
        ts = [threading.Thread(target=m.start, kwargs={"timeout": 60})
              for m in nodes[i:i + 4]]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return nodes


def _voters_settled(nodes: list[Mount], excluded: str | None = None,
                    timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rafts = [_raft(m) for m in nodes]
        voters = {tuple(r.get("voters", [])) for r in rafts}
        if (len(voters) == 1 and len(next(iter(voters))) == VOTERS
                and excluded not in next(iter(voters))
                and len({r.get("leader") for r in rafts}) == 1 and rafts[0].get("leader")
                and sum(r.get("role") == "learner" for r in rafts) == len(nodes) - VOTERS):
            return rafts
        assert time.monotonic() < deadline, [(r.get("role"), r.get("voters")) for r in rafts]
        time.sleep(0.3)


def test_eight_nodes_five_voters_learners_and_a_leader_killed(cluster: Cluster) -> None:
    nodes = _start(cluster, N)
    cluster.wait_members(nodes, N, timeout=60)
    rafts = _voters_settled(nodes)
    learners = [m for m, r in zip(nodes, rafts, strict=True) if r["role"] == "learner"]
    learner_addrs = {r["self"] for r in rafts if r["role"] == "learner"}
    # A learner has no vote, and no connection to the voters: reaching them is judged
    # by membership (it was shown as cut off from the majority). (The voters connect to
    # the last one promoted within pysyncobj's connectionRetryTime, 1 s, of its start: a
    # CI run looked before they had, on a slow machine.)
    deadline = time.monotonic() + 10
    while cut := [(str(m.mnt), p) for m in nodes
                  if (p := _local(m)["cluster"]["partition"])["cut_off"]
                  or p["raft_unreachable"]]:
        assert time.monotonic() < deadline, cut
        time.sleep(0.2)

    # At rest (nothing written yet, so nothing to write back) each node sends about one
    # probe per period (0.75 s at --peer-timeout 3), plus a learner's long-poll of the
    # log every 5 s: not one ping per member per period (7 here, 31 at 32 nodes).
    before = [_local(m)["cluster"]["peer_requests_by_op"] for m in nodes]
    time.sleep(6)
    after = [_local(m)["cluster"]["peer_requests_by_op"] for m in nodes]
    rates = [{op: (n - was.get(op, 0)) / 6 for op, n in now.items() if n > was.get(op, 0)}
             for was, now in zip(before, after, strict=True)]
    assert max(sum(r.values()) for r in rates) < 3.0, rates

    # Close-to-open from one learner to another: each read sees the bytes just closed.
    # The reader's barriers commit nothing: the leader confirms its commit index with a
    # majority of the voters (a read index), and the reader applies that far.
    a, b = learners[0], learners[1]
    (a.mnt / "c2o").mkdir()
    reads0 = _raft(b)["read_index"]
    for i in range(10):
        data = os.urandom(1000 + i)
        (a.mnt / "c2o" / f"f{i}").write_bytes(data)
        assert (b.mnt / "c2o" / f"f{i}").read_bytes() == data
    reads1 = _raft(b)["read_index"]
    assert reads1["confirmed"] - reads0["confirmed"] >= 10, (reads0, reads1)
    assert reads1["fallbacks"] == reads0["fallbacks"], (reads0, reads1)

    # kill -9 the leader: a learner keeps committing (within --txn-timeout), and one is
    # promoted so that five voters remain.
    leader = next(m for m, r in zip(nodes, rafts, strict=True) if r["role"] == "leader")
    dead = next(r["self"] for r in rafts if r["role"] == "leader")
    writer = learners[-1]
    assert leader.kill9()
    t0 = time.monotonic()
    (writer.mnt / "after").mkdir()
    (writer.mnt / "after" / "f").write_bytes(b"committed")
    resumed = time.monotonic() - t0
    assert resumed < 10, resumed  # --txn-timeout
    survivors = [m for m in nodes if m is not leader]
    rafts = _voters_settled(survivors, excluded=dead, timeout=60)
    assert learner_addrs & set(rafts[0]["voters"]), "no learner was promoted"
    assert (learners[0].mnt / "after" / "f").read_bytes() == b"committed"
    for m in survivors:
        assert not m.errors_in_log(), m.errors_in_log()


def test_a_learner_restarted_without_peers_finds_its_cluster(cluster: Cluster) -> None:
    """A member remembers the members it has seen (peers.json in its cache dir) and tries
    them at its next start besides --peers. A learner keeps no Raft state on disk, so the
    first node (started with no peers) restarted after a demotion formed a group of one
    and served an empty namespace until it found the cluster: a read of an acknowledged
    file gave ENOENT (the partition nemesis with learners, seed 4302)."""
    a = cluster.add("--raft-voters", "1")
    b = cluster.add("--raft-voters", "1")
    cluster.wait_raft([a, b], 1)
    (a.mnt / "f").write_bytes(b"acknowledged")
    assert _raft(b)["role"] == "learner"
    peers = b.cache / "peers.json"
    deadline = time.monotonic() + 30
    while not peers.exists():  # (written within REMEMBER_EVERY of the join)
        assert time.monotonic() < deadline, "peers.json not written"
        time.sleep(0.2)
    b.kill9()
    i = b.extra.index("--peers")
    b.extra = (*b.extra[:i], *b.extra[i + 2:])
    b.start()
    assert (b.mnt / "f").read_bytes() == b"acknowledged"
    assert _raft(b)["role"] == "learner"
