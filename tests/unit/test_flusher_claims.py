"""Write-back of a big blob by two nodes at once: the one that cannot claim the key leaves
it alone before pulling or uploading a byte (a flush on the writer and the key's owner both
uploaded a 1 GiB checkpoint, and the loser's pulled blob was dropped under it: "unexpected
error writing back"); a blob dropped because the other node's clean landed is not an error.
"""

from __future__ import annotations

import stat
import threading
from typing import Any

import pytest

from objcache.entries import Attrs, FileEntry
from objcache.txn.flusher import Busy, ClusterFlusher

CHUNK = 16 << 20


class Ns:
    def __init__(self, key: str, e: FileEntry) -> None:
        self.entries = {key: e}

    def get(self, key: str) -> FileEntry | None:
        return self.entries.get(key)

    def referenced(self, key: str) -> bool:
        return False


class State:
    def __init__(self, ns: Ns) -> None:
        self.lock = threading.Lock()
        self.ns = ns
        self.applied = 0


class Txn:
    node_id = "a"

    def __init__(self, ns: Ns, claimed_by: str | None) -> None:
        self.state = State(ns)
        self.claimed_by = claimed_by
        self.pulled: list[str] = []
        self.ops: list[str] = []

    async def submit(self, cmd: dict[str, Any], background: bool = False) -> dict[str, Any]:
        self.ops.append(cmd["op"])
        if cmd["op"] == "ns.claim" and self.claimed_by:
            return {"ok": False, "by": self.claimed_by}
        return {"ok": True}

    async def pull(self, cid: str, size: int, holders: list[str]) -> None:
        self.pulled.append(cid)


class Dirty:
    def has(self, cid: str) -> bool:
        return False

    def path(self, cid: str) -> str:
        return f"/nonexistent/{cid}"


class Store:
    def __init__(self) -> None:
        self.puts: list[str] = []

    async def put_file(self, key: str, path: str, size: int, meta: dict[str, str],
                       part_size: int, fence: Any = None) -> str:
        self.puts.append(key)
        raise FileNotFoundError(path)


def flusher(claimed_by: str | None, size: int) -> tuple[ClusterFlusher, Txn, Store, Ns]:
    e = FileEntry(Attrs(stat.S_IFREG | 0o644, 0, 0, 0), size, "c1", ("b", "c"), ver=7)
    ns = Ns("ckpt.pt", e)
    txn, store = Txn(ns, claimed_by), Store()
    f = ClusterFlusher(store, txn, Dirty(), CHUNK, 0.0, None, None)  # type: ignore[arg-type]
    return f, txn, store, ns


async def test_a_big_blob_another_node_is_writing_is_not_pulled_nor_uploaded() -> None:
    f, txn, store, ns = flusher("b", 4 * CHUNK)
    with pytest.raises(Busy):
        await f.upload("ckpt.pt", ns.entries["ckpt.pt"])
    assert txn.pulled == [] and store.puts == []


async def test_a_blob_gone_with_its_entry_is_busy_not_an_error() -> None:
    f, txn, store, ns = flusher(None, 4 * CHUNK)
    e = ns.entries.pop("ckpt.pt")  # the other node's clean landed meanwhile
    with pytest.raises(Busy):
        await f.upload("ckpt.pt", e)
    assert store.puts == ["ckpt.pt"]


async def test_a_blob_missing_while_its_entry_stands_is_still_an_error() -> None:
    f, txn, store, ns = flusher(None, CHUNK)  # one part: no claim before the bytes
    with pytest.raises(FileNotFoundError):
        await f.upload("ckpt.pt", ns.entries["ckpt.pt"])
    assert txn.ops == ["ns.holders"]
