"""Daemons on test hosts of their own (tests/helpers/netns.py), with links cut and healed:
a close that fails on a node cut off from the majority never takes effect after the heal,
and a short run of the partition nemesis (tests/helpers/partition.py; long runs are
scripts/partitions.py's) passes its history checks."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import netns, partition
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import SeaweedFS

FLAGS = ("--writeback-delay", "2", "--txn-timeout", "4")


@pytest.fixture
def net() -> Iterator[netns.TestNet]:
    why = netns.why_not()
    if why:
        pytest.skip(f"cannot make test hosts here: {why}")
    made = netns.TestNet(3)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def hosts(net: netns.TestNet, seaweed: SeaweedFS) -> netns.TestNet:
    net.start_s3(seaweed.port)
    return net


@pytest.fixture
def pcluster(hosts: netns.TestNet, mounts: list[Mount], seaweed: SeaweedFS, bucket: str,
             tmp_path: Path) -> Cluster:
    # (`hosts` before `mounts`: the daemons stop before their network goes)
    return Cluster(seaweed.endpoint, bucket, tmp_path, mounts, hosts)


def _leader(c: Cluster, nodes: list[Mount]) -> int:
    host = nodes[0].status()["cluster"]["raft"]["leader"].rpartition(":")[0]
    return [c.hosts.ip(i) for i in range(len(nodes))].index(host)  # type: ignore[union-attr]


def test_a_failed_close_does_not_take_effect_after_the_heal(pcluster, hosts, s3, bucket
                                                            ) -> None:  # type: ignore[no-untyped-def]
    nodes = [pcluster.add(*FLAGS) for _ in range(3)]
    pcluster.wait_raft(nodes, 3)
    i = (_leader(pcluster, nodes) + 1) % 3  # a follower
    m = nodes[i]
    (m.mnt / "f").write_bytes(b"acknowledged")
    for j in range(3):
        if j != i:
            hosts.cut(i, j)
    time.sleep(5)  # its Raft member notices (connection timeout 3.5 s)
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        (m.mnt / "f").write_bytes(b"failed write")
    took = time.monotonic() - t0
    assert e.value.errno == errno.EIO, e.value
    # open's barrier (3 s), replication attempts (up to --peer-timeout), --txn-timeout
    assert took < 3 + 3 + 4 + 3, took
    # `status` says the node is cut off, and from whom; a node of the majority is not.
    pt = m.status()["cluster"]["partition"]
    assert pt["cut_off"] and pt["cut_off_seconds"] >= 5, pt
    others = {n.addr for n in nodes if n is not m}  # type: ignore[attr-defined]
    assert {u["id"] for u in pt["unreachable"]} == others, pt
    assert len(pt["raft_unreachable"]) == 2, pt
    assert not nodes[(i + 1) % 3].status()["cluster"]["partition"]["cut_off"]
    out = objcache("status", str(m.mnt)).stdout
    assert "CUT OFF from the majority" in out and all(o in out for o in others), out
    hosts.heal()
    # The release after the failed close, or the node's next close, committed it again
    # once the network healed: every node and S3 had the failed write's bytes.
    pcluster.wait_raft(nodes, 3, timeout=30)
    time.sleep(2)
    for n in nodes:
        assert (n.mnt / "f").read_bytes() == b"acknowledged", n.mnt
    (nodes[(i + 1) % 3].mnt / "g").write_bytes(b"after")  # the cluster still commits
    objcache("flush", str(nodes[0].mnt))
    assert s3.get_object(Bucket=bucket, Key="f")["Body"].read() == b"acknowledged"
    assert (m.mnt / "g").read_bytes() == b"after"


def test_partition_nemesis_short(pcluster, hosts, s3, bucket) -> None:  # type: ignore
    seed = int(os.environ.get("PARTITION_SEED", time.time_ns() % 1_000_000))
    # (before the run: a run that fails on its way, e.g. no leader after the heal, must
    # still name the seed that reproduces it; one such failure on 2026-11-27 did not)
    print(f"partition seed {seed} (PARTITION_SEED={seed} repeats this run)", flush=True)
    res = partition.run(hosts, pcluster, s3, bucket, seconds=25, seed=seed)
    print(f"partition seed {seed}: {res.summary()}")
    for e in res.events:
        print(f"  fault at {e.t0 - res.t_start:.1f}s: {e.kind} {e.detail}")
    for e in res.eios:
        print(f"  {e}")
    for e in res.errors:
        print(f"  VIOLATION {e}")
    assert res.counts["acked_writes"] > 20, res.summary()
    assert not res.errors, (seed, res.errors[:10])
