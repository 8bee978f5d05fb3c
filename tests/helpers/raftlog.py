"""A Raft member's state for in-process tests of objcache/raft/node.py: it records the
commands it applied; and submitting until the group has a leader."""

from __future__ import annotations

import threading
from typing import Any

import trio

from objcache.errors import NoQuorum
from objcache.raft.node import RaftNode


class Log:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.seen = d["seen"]
        self.lock = threading.Lock()

    def apply(self, cmd: dict[str, Any]) -> Any:
        with self.lock:
            self.seen.append(str(cmd.get("name")))
        return {"ok": True}


async def submit_once_led(node: RaftNode, name: str, limit: float) -> None:
    """Submit a command, again until the group has a leader (at most `limit` seconds)."""
    with trio.fail_after(limit):
        while True:
            try:
                await node.submit({"name": name}, timeout=2.0)
                return
            except NoQuorum:
                await trio.sleep(0.1)
