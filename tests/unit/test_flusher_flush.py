"""What fails a flush (objcache/txn/flusher.py): a write-back the flush asked for, not one
already on its way when the flush began (the partition nemesis, seed 5963: a claim
submitted on a leader cut off from its peers failed after the heal, inside the checker's
final flush, which reported it although the retry 2 s later went through)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from objcache.cache.quarantine import Quarantine
from objcache.entries import FlushScope, Tombstone
from objcache.errors import NoQuorum, StoreError
from objcache.txn.flusher import ClusterFlusher


class Ns:
    def __init__(self) -> None:
        self.entries: dict[str, Tombstone] = {"gone": Tombstone(at=0.0, ver=3)}

    def referenced(self, key: str) -> bool:
        return False

    def cids(self) -> set[str]:
        return set()


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ns = Ns()
        self.applied = 0


class Txn:
    """The log as a cut-off leader saw it: each claim waits for `release`, then fails
    or commits as `fail` says."""

    node_id = "a"
    timeout = 5.0

    def __init__(self) -> None:
        self.state = State()
        self.release = trio.Event()
        self.fail: list[bool] = []
        self.claims = 0
        self.claiming = trio.Event()

    def caught_up(self) -> bool:
        return True

    def owner(self, key: str) -> str:
        return self.node_id

    async def submit(self, cmd: dict[str, Any], background: bool = False) -> dict[str, Any]:
        if cmd["op"] == "ns.claim":
            self.claims += 1
            self.claiming.set()
            await self.release.wait()
            if self.fail.pop(0):
                raise NoQuorum("ns.claim of 'gone' could not commit within 5s (raft batch "
                               "of 1 got no answer in 5s); fenced: it never takes effect")
        elif cmd["op"] == "ns.clean":
            with self.state.lock:
                self.state.ns.entries.pop(cmd["key"], None)
        return {"ok": True}


class Store:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def delete(self, key: str) -> None:
        self.deleted.append(key)


class Space:
    crowded = False


class Dirty:
    def gc(self, referenced: set[str]) -> None:
        pass


def flusher(tmp: Path, fail: list[bool]) -> tuple[ClusterFlusher, Txn, Store]:
    txn, store = Txn(), Store()
    txn.fail = fail
    f = ClusterFlusher(store, txn, Dirty(), 1 << 20, 0.5, Space(),  # type: ignore[arg-type]
                       Quarantine(tmp))
    f._urgent = None  # (everything is due at once)
    return f, txn, store


@pytest.mark.parametrize("before", [True, False], ids=["begun-before", "begun-after"])
async def test_a_write_back_already_running_fails_no_flush(tmp_path: Path,
                                                           before: bool) -> None:
    f, txn, store = flusher(tmp_path, [True, False])
    async with trio.open_nursery() as nursery:
        if before:
            nursery.start_soon(f.run)
            await txn.claiming.wait()  # the claim is on its way
        result: list[int | BaseException] = []

        async def flush() -> None:
            try:
                result.append(await f.flush(FlushScope.everything()))
            except StoreError as e:
                result.append(e)

        nursery.start_soon(flush)
        if not before:
            await trio.sleep(0.05)  # the flush began first
            nursery.start_soon(f.run)
            await txn.claiming.wait()
        await trio.sleep(0.05)
        txn.release.set()  # the first claim fails now, after the flush began
        with trio.fail_after(5):
            while not result:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    if before:
        assert result == [1] and txn.claims == 2 and store.deleted == ["gone"]
    else:  # the flush's own attempt failed: the flush says so
        assert isinstance(result[0], StoreError) and "could not commit" in str(result[0])
        assert txn.claims == 1 and store.deleted == []
