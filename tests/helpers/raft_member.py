"""A Raft member process for the stress test: runs `clients` concurrent tasks that each
commit `commands` puts and counter increments (exactly-once by transaction id, retried
through leader loss), then keeps reporting its state digest to a JSON file until killed.

python -m tests.helpers.raft_member ADDR PARTNERS DIR SECRET CLIENTS COMMANDS OUT
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import trio

from objcache.raft.node import NoQuorum, RaftNode


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
               commands: int, out: str) -> None:
    name = addr.replace(":", "_")
    node = RaftNode(addr, partners.split(","), Path(data), secret)
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
    trio.run(main, a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), a[6])
