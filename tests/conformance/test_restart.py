"""A cluster restarted all at once: a node that comes back before its seed is up forms a
ring of its own until it retries its seeds (every 5 s), and a node started without seeds
(the first one) hears of the others only when they do. The Raft group is whole again at
once (its members are in the log), so closes commit meanwhile: each must still be on
--replicas nodes when close() returns (chaos seed 3120: node 0's closes were acknowledged
with its own copy only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.backend.replicated import ReplicatedBackend
from objcache.cluster import membership
from objcache.cluster import node as cluster_node
from objcache.cluster.node import bind_listener, raft_address
from objcache.config import MountConfig
from objcache.daemon import Parts
from objcache.errors import UserError
from tests.helpers.cluster import free_port
from tests.helpers.inproc import Posix, config, node
from tests.helpers.memstore import MemoryStore


def _ring(p: Parts) -> set[str]:
    assert p.member is not None
    return set(p.member.node.membership.ring.members)


async def _caught_up(*parts: Parts) -> None:
    with trio.fail_after(30):
        for p in parts:
            assert isinstance(p.backend, ReplicatedBackend)
            while not p.backend.txn.caught_up() or len(p.backend.txn.state.members) < 2:
                await trio.sleep(0.05)


async def _ports_free(*cfgs: MountConfig) -> None:
    """pysyncobj's thread closes a stopped member's Raft port a moment later."""
    with trio.fail_after(10):
        for c in cfgs:
            while True:
                try:
                    bind_listener(raft_address(c)).close()
                    break
                except UserError:
                    await trio.sleep(0.05)


async def test_a_close_after_an_all_at_once_restart_is_on_two_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The window in which the others have not retried their seeds yet, made to last.
    monkeypatch.setattr(membership, "SEED_RETRY_SECONDS", 3600.0)
    # (and no wait for the seed at the start: here it stays down until we formed a ring)
    monkeypatch.setattr(cluster_node, "JOIN_PATIENCE", 0.0)
    store = MemoryStore()
    secret = tmp_path / "cluster.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    a0, a1 = (f"127.0.0.1:{free_port()}" for _ in range(2))
    common = {"cluster_secret_file": str(secret), "catch_up_seconds": 1.0}
    c0 = config(listen=a0, raft_port=free_port(), node_id="n0", **common)
    c1 = config(listen=a1, raft_port=free_port(), node_id="n1", peers=a0, **common)
    async with node(c0, store, tmp_path / "n0") as p0, node(c1, store, tmp_path / "n1") as p1:
        await _caught_up(p0, p1)
        assert _ring(p0) == _ring(p1) == {"n0", "n1"}
    await _ports_free(c0, c1)
    # Both killed at once; n1 comes back first (its seed, n0, is down: it forms a ring of
    # its own), then n0, which has no seeds. Each runs in a task of its own, so that n1's
    # first barrier commits as soon as n0 is back.
    up: dict[str, Parts] = {}
    caplog.clear()

    async def run(name: str, cfg: MountConfig) -> None:
        async with node(cfg, store, tmp_path / name) as p:
            up[name] = p
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "n1", c1)
        with trio.fail_after(10):
            while not any("no peer reachable" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.02)
        nursery.start_soon(run, "n0", c0)
        with trio.fail_after(30):
            while "n0" not in up:
                await trio.sleep(0.05)
        p0 = up["n0"]
        await _caught_up(p0)
        # (n1 is not waited for: its first barrier may wait out its 5 s timeout, and its
        # Raft member and peer server are up already)
        assert _ring(p0) == {"n0"}  # n0 has heard of nobody
        data = os.urandom(300_000)
        await Posix(p0.fs).write("ckpt", data)
        assert isinstance(p0.backend, ReplicatedBackend)
        e = p0.backend.entry("ckpt")
        assert e is not None and set(e.holders) == {"n0", "n1"}  # (was: n0 alone)
        nursery.cancel_scope.cancel()  # both killed (n1 may still be starting)
