"""A member keeps the addresses of the members it sees alive in its cache dir
(`peers.json`), and keeps them current as members come and go: a node restarted without
`--peers` (the first node, or one whose seed left) finds its cluster through them instead
of forming a group of one (the partition nemesis with learners, seed 4302)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from objcache.cluster.membership import ALIVE, DEAD, Member
from objcache.cluster.node import PEERS_FILE, REMEMBER_EVERY, ClusterNode, remembered_peers


async def _kept(path: Path, want: list[str]) -> list[str]:
    """What `path` holds once it holds `want`, or after a minute of the test's clock."""
    with trio.move_on_after(60):
        while remembered_peers(path) != want:
            await trio.sleep(0.01)
    return remembered_peers(path)


def _writes_inline(monkeypatch: Any) -> list[float]:
    """Run the loop's file writes in the test's own thread, and note the (virtual) time of
    each. In a worker thread, the autojump clock went on jumping while the thread ran:
    the test's 0.01 s polls advanced it 4.75 s per 10 ms of real time here, so a write
    finished 11.03 s after the change on a busy machine (a full-suite run, 2026-11-28)
    though the loop had started it on time."""
    at: list[float] = []

    async def run_sync(fn: Any, *args: Any, **_: Any) -> Any:
        at.append(trio.current_time())
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    return at


async def test_the_remembered_addresses_follow_the_members(tmp_path: Path,
                                                           autojump_clock: Any,
                                                           monkeypatch: Any) -> None:
    writes = _writes_inline(monkeypatch)
    me = Member("me", "127.0.0.1:1", 1, 1)
    members = {name: Member(name, f"127.0.0.1:{port}", 1, 1)
               for name, port in (("a", 2), ("b", 3))}
    node: Any = SimpleNamespace(
        membership=SimpleNamespace(me=me, members={"me": me, **members}),
        _peers_file=tmp_path / PEERS_FILE, _disk=trio.CapacityLimiter(1))
    node._write_peers = lambda addrs: ClusterNode._write_peers(node, addrs)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ClusterNode._remember_peers, node)
        assert await _kept(node._peers_file, ["127.0.0.1:2", "127.0.0.1:3"]) == [
            "127.0.0.1:2", "127.0.0.1:3"]
        assert json.loads(node._peers_file.read_text()) == ["127.0.0.1:2", "127.0.0.1:3"]
        members["b"].state = DEAD  # b went, c came
        node.membership.members["c"] = Member("c", "127.0.0.1:4", 1, 1, state=ALIVE)
        t0 = trio.current_time()
        assert await _kept(node._peers_file, ["127.0.0.1:2", "127.0.0.1:4"]) == [
            "127.0.0.1:2", "127.0.0.1:4"]
        assert len(writes) == 2
        assert writes[1] - t0 <= REMEMBER_EVERY + 1
        nursery.cancel_scope.cancel()
