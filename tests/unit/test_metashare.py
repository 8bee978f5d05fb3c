"""The cluster's shared metadata (objcache/cluster/metashare.py) when a peer misbehaves: a
refused or failed request is a miss (the caller HEADs), never an error that reaches the
core or ends the background push."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from objcache.cache.objmeta import ObjectMeta
from objcache.cache.statedb import StateDB
from objcache.cluster.metashare import SharedObjectMeta
from objcache.errors import ProtocolError
from objcache.store import ObjectInfo


class RefusingClient:
    def __init__(self) -> None:
        self.calls = 0

    async def call(self, node: str, msg: dict[str, Any], *args: Any) -> Any:
        self.calls += 1
        raise ProtocolError(f"{node} refuses {msg['op']}")


async def test_a_refusing_owner_is_a_miss_and_the_push_goes_on(tmp_path: Path) -> None:
    membership = SimpleNamespace(me=SimpleNamespace(id="me"), owner=lambda point: "peer")
    client = RefusingClient()
    shared = SharedObjectMeta(ObjectMeta(StateDB(tmp_path / "state.db")), membership,  # type: ignore[arg-type]
                              client, 1.0)  # type: ignore[arg-type]
    known = ObjectInfo("d/a", 1, '"e1"', 5_000_000_000, {"mode": "33188"})
    shared.remember(known)  # kept here, and queued for its owner
    listed = [ObjectInfo("d/a", 1, '"e1"', 5_000_000_000), ObjectInfo("d/b", 1, '"e2"', 0)]
    assert await shared.lookup(listed) == {"d/a": {"mode": "33188"}}  # b: a miss
    async with trio.open_nursery() as n:
        await n.start(shared.run)
        # (pushes go out on the process's 0.25 s grid: PUSH_SECONDS to 0.25 s later)
        await trio.sleep(0.8)  # the push of a's answer: refused
        shared.remember(ObjectInfo("d/c", 1, '"e3"', 0, {}))
        await trio.sleep(0.8)  # the loop goes on: c's push, refused too
        n.cancel_scope.cancel()
    assert client.calls == 3  # one meta.get, two meta.put
