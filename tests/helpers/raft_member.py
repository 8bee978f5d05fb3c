"""A Raft member process for the stress test: runs `clients` concurrent tasks that each
commit `commands` puts and counter increments (exactly-once by transaction id, retried
through leader loss), then keeps reporting its state digest to a JSON file until killed.

python -m tests.helpers.raft_member ADDR PARTNERS DIR SECRET CLIENTS COMMANDS OUT [COMPACT]

COMPACT: the member compacts its log (a dump of the state) every that many entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
import trio

from objcache.errors import NoQuorum
from objcache.raft.node import COMPACT_ENTRIES, RaftNode


class Counters:
    """A test state machine: versioned records with put and compare-and-set, and
    exactly-once application by transaction id (as objcache.txn.state does)."""

    def __init__(self) -> None:
        self.records: dict[str, tuple[int, Any]] = {}
        self._tx: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        with self.lock:
            d = dict(self.__dict__)
        del d["lock"]
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.lock = threading.Lock()

    def apply(self, cmd: dict[str, Any]) -> Any:
        with self.lock:
            tx = cmd.get("tx")
            if tx in self._tx:
                return self._tx[tx]
            key = str(cmd.get("key"))
            current = self.records.get(key, (0, None))[0]
            if cmd.get("op") == "put":
                self.records[key] = (current + 1, cmd.get("value"))
                result: Any = {"ok": True, "version": current + 1}
            elif cmd.get("op") == "cas" and int(cmd.get("version", -1)) == current:
                self.records[key] = (current + 1, cmd.get("value"))
                result = {"ok": True, "version": current + 1}
            elif cmd.get("op") == "cas":
                result = {"ok": False, "version": current}
            else:
                result = {"error": f"unknown op {cmd.get('op')!r}"}
            if tx is not None:
                self._tx[tx] = result
            return result

    def get(self, key: str) -> tuple[int, Any]:
        with self.lock:
            return self.records.get(key, (0, None))

    def digest(self) -> str:
        with self.lock:
            blob = msgpack.packb(sorted((k, list(v)) for k, v in self.records.items()))
        return hashlib.sha256(blob).hexdigest()


async def _commit(node: RaftNode, cmd: dict) -> dict:  # type: ignore[type-arg]
    while True:
        try:
            return await node.submit(cmd, timeout=5)
        except NoQuorum:
            await trio.sleep(0.2)  # same tx id: applied once however often we retry


async def _client(node: RaftNode, name: str, task: int, commands: int,
                  progress: list[int]) -> None:
    for i in range(commands):
        await _commit(node, {"op": "put", "tx": f"{name}/{task}/p{i}",
                             "key": f"k/{name}/{task}/{i}", "value": i})
        if i % 5 == 0:  # a contended counter: read, then compare-and-set, until it sticks
            attempt = 0
            while True:
                version, value = node.state.get("counter")
                r = await _commit(node, {"op": "cas", "tx": f"{name}/{task}/c{i}/{attempt}",
                                         "key": "counter", "version": version,
                                         "value": (value or 0) + 1})
                if r["ok"]:
                    break
                attempt += 1
        progress[0] += 1


def _write(out: str, st: dict) -> None:  # type: ignore[type-arg]
    with open(out + ".tmp", "w") as f:
        json.dump(st, f)
    os.replace(out + ".tmp", out)


async def main(addr: str, partners: str, data: str, secret: str, clients: int,
               commands: int, out: str, compact: int = COMPACT_ENTRIES) -> None:
    name = addr.replace(":", "_")
    node = RaftNode(addr, partners.split(","), Path(data), secret, Counters(),
                    compact_entries=compact)
    progress = [0]
    done = False

    async def report() -> None:
        while True:
            st = node.status()
            st.update(digest=node.state.digest(), records=len(node.state.records),
                      counter=node.state.get("counter")[1], progress=progress[0], done=done,
                      pid=os.getpid())
            _write(out, st)
            await trio.sleep(0.2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        async with trio.open_nursery() as work:
            for t in range(clients):
                work.start_soon(_client, node, name, t, commands, progress)
        done = True
        await trio.sleep_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = sys.argv[1:]
    trio.run(main, a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), a[6],
             *(int(x) for x in a[7:8]))
