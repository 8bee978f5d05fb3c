"""Members started together, from zero, form one Raft group. A node whose seed was not
listening yet (started a moment after it) formed a group of its own at once; a node that
joined through it followed that group and was promoted to vote in it, so the group no
longer yielded to the seed's when the two met: two namespaces in one cluster (the scale
harness, 16 nodes started 4 at a time: a group of 5 voters and one of 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.cluster import membership
from objcache.config import MountConfig
from objcache.daemon import Parts
from tests.helpers.cluster import free_port
from tests.helpers.inproc import config, node
from tests.helpers.memstore import MemoryStore


def _group(p: Parts) -> tuple[str, int]:
    assert p.member is not None
    raft = p.member.node.raft
    cur = raft.raft
    return raft.group, len(cur.members()) if cur is not None else 0


async def test_a_node_whose_seed_is_not_up_yet_joins_it_instead_of_forming_a_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (membership's background retry of the seeds is not what brings them together)
    monkeypatch.setattr(membership, "SEED_RETRY_SECONDS", 3600.0)
    store = MemoryStore()
    secret = tmp_path / "cluster.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    a0, a1, a2 = (f"127.0.0.1:{free_port()}" for _ in range(3))
    common = {"cluster_secret_file": str(secret), "catch_up_seconds": 1.0}
    cfgs = {"n0": config(listen=a0, raft_port=free_port(), node_id="n0", **common),
            "n1": config(listen=a1, raft_port=free_port(), node_id="n1", peers=a0, **common),
            "n2": config(listen=a2, raft_port=free_port(), node_id="n2", peers=a1, **common)}
    up: dict[str, Parts] = {}

    async def run(name: str, cfg: MountConfig) -> None:
        async with node(cfg, store, tmp_path / name) as p:
            up[name] = p
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "n1", cfgs["n1"])
        nursery.start_soon(run, "n2", cfgs["n2"])  # its seed, n1, is up at once
        await trio.sleep(1.0)
        nursery.start_soon(run, "n0", cfgs["n0"])  # n1's seed, a second late
        with trio.fail_after(30):
            while len(up) < 3 or len({_group(p)[0] for p in up.values()}) != 1 or not all(
                    _group(p)[0] for p in up.values()):
                await trio.sleep(0.1)
        groups = {name: _group(p) for name, p in up.items()}
        assert len({g for g, _ in groups.values()}) == 1, groups
        nursery.cancel_scope.cancel()
