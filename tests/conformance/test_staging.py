"""Replication while writing: the replica of a file being written pulls its complete chunks
as they are written, and close() has it fetch only the rest; a change behind what was
staged makes close() pull the whole file. Either way the replica holds exactly the closed
content."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.backend.replicated import ReplicatedBackend
from tests.helpers.inproc import MiB, Posix, cluster
from tests.helpers.memstore import MemoryStore


def _blob(p, cid: str) -> bytes:  # type: ignore[no-untyped-def]
    assert isinstance(p.backend, ReplicatedBackend)
    return Path(p.backend.dirty.path(cid)).read_bytes()


@pytest.mark.parametrize("rewrite", [False, True])
async def test_the_replica_pulls_while_the_file_is_written(rewrite: bool,
                                                           tmp_path: Path) -> None:
    async with cluster(MemoryStore(), tmp_path, 2) as (p0, p1):
        b0, b1 = p0.backend, p1.backend
        assert isinstance(b0, ReplicatedBackend) and isinstance(b1, ReplicatedBackend)
        data = bytearray(os.urandom(6 * MiB + 12345))
        fs = Posix(p0.fs)
        fh = await fs.create("ckpt.pt")
        for off in range(0, len(data), MiB):
            await p0.fs.write(fh, off, bytes(data[off:off + MiB]))
        with trio.fail_after(10):
            while b1.dirty.staged_bytes < 6 * MiB:
                await trio.sleep(0.02)
        assert not b1.dirty.sizes  # staged bytes are nobody's blob before the close
        if rewrite:
            await p0.fs.write(fh, 10, b"changed")
            data[10:17] = b"changed"
        await fs.close(fh)
        e = b0.entry("ckpt.pt")
        assert e is not None and e.cid is not None and len(e.holders) == 2
        assert _blob(p1, e.cid) == bytes(data)
        assert not b1.dirty.stages and not b0.dirty.exposed
        assert not list(b1.dirty.root.glob("*.stage"))


async def test_a_file_written_back_empty_during_its_close_keeps_what_close_commits(
        tmp_path: Path) -> None:
    # The create commits an empty file, and its owner writes that back after the delay even
    # while the writer is still writing; write-back then forgets the entry. When that clean
    # lands in the log just before the writer's commit, the commit used to be refused as
    # "removed meanwhile" and close() returned success having dropped the data.
    store = MemoryStore()
    async with cluster(store, tmp_path, 2, writeback_delay=0.3) as (p0, p1):
        b0 = p0.backend
        assert isinstance(b0, ReplicatedBackend)
        fs = Posix(p0.fs)
        submit = b0.txn.submit

        async def late_commit(cmd):  # type: ignore[no-untyped-def]
            if cmd.get("op") == "ns.commit" and cmd["must_exist"]:  # it was there
                with trio.fail_after(10):  # the owner's clean of the empty file goes first
                    while "slow.pt" not in store.objects or b0.entry("slow.pt") is not None:
                        await trio.sleep(0.02)
            return await submit(cmd)

        b0.txn.submit = late_commit  # type: ignore[method-assign]
        fh = await fs.create("slow.pt")
        await p0.fs.write(fh, 0, b"all of it")
        await fs.close(fh)
        assert store.objects["slow.pt"][0] == b""
        assert await Posix(p1.fs).read("slow.pt") == b"all of it"
        with trio.fail_after(10):
            while store.objects["slow.pt"][0] != b"all of it":
                await trio.sleep(0.05)
