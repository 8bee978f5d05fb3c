"""Streaming write-back on one node: a file written front to back has its complete parts
in S3 (as parts of an unfinished multipart upload) before it is closed, and the write-back
of the closed file sends only the rest; a change behind what was sent, a rename or a
failed part makes it go up whole, byte-exact; an unclosed file is never completed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from tests.helpers.inproc import FaultyStore, MiB, Posix, config, node
from tests.helpers.memstore import MemoryStore

# parts start at 5 MiB (S3's minimum) when chunks are smaller
PART = 5 * MiB


async def _wait(pred, what: str, seconds: float = 10) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(seconds):
        while not pred():
            await trio.sleep(0.02)


async def _append(p, fh: int, data: bytes, at: int = 0) -> None:  # type: ignore[no-untyped-def]
    for off in range(0, len(data), MiB):
        await p.fs.write(fh, at + off, data[off:off + MiB])


async def test_a_sequential_writer_streams_its_parts_before_close(tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    data = os.urandom(4 * PART + 2 * MiB)
    async with node(config(), store, tmp_path / "node") as p:
        fs = Posix(p.fs)
        fh = await fs.create("ckpt.pt")
        await _append(p, fh, data)
        await _wait(lambda: store.inner.calls["upload_part"] == 4, "4 parts sent")
        await trio.sleep(0.2)
        assert "ckpt.pt" not in store.inner.objects  # never completed while open
        assert len(store.inner.uploads) == 1
        await fs.close(fh)  # due at once, although the write-back delay is an hour
        await _wait(lambda: "ckpt.pt" in store.inner.objects, "object complete")
        assert store.inner.objects["ckpt.pt"][0] == data
        assert store.inner.calls["upload_part"] == 5  # the tail only; nothing sent twice
        assert store.inner.calls["put"] == 0
        assert "mtime" not in store.inner.objects["ckpt.pt"][1]
        st = p.backend.stats()
        assert (st.streamed, st.stream_fallbacks, st.dirty_files) == (1, 0, 0)
        assert await fs.read("ckpt.pt") == data


@pytest.mark.parametrize("change", ["rewrite", "truncate", "rename", "chmod"])
async def test_a_change_behind_the_stream_makes_the_file_go_up_whole(
        change: str, tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    data = bytearray(os.urandom(3 * PART))
    async with node(config(), store, tmp_path / "node") as p:
        fs = Posix(p.fs)
        fh = await fs.create("ckpt.pt")
        await _append(p, fh, bytes(data))
        await _wait(lambda: store.inner.calls["upload_part"] >= 2, "parts sent")
        key = "ckpt.pt"
        if change == "rewrite":
            await p.fs.write(fh, 100, b"X" * 100)
            data[100:200] = b"X" * 100
        elif change == "truncate":
            await fs.truncate("ckpt.pt", PART + 7)
            del data[PART + 7:]
        elif change == "rename":
            await fs.rename("ckpt.pt", "moved.pt")
            key = "moved.pt"
        else:
            await fs.chmod("ckpt.pt", 0o600)
        await _append(p, fh, b"tail", len(data))
        data += b"tail"
        await fs.close(fh)
        await _wait(lambda: key in store.inner.objects, "object complete")
        assert store.inner.objects[key][0] == bytes(data)
        assert store.inner.uploads == {}  # the stream's upload was aborted
        assert store.inner.aborted == 1
        assert p.backend.stats().stream_fallbacks == 1
        assert "ckpt.pt" not in store.inner.objects or key == "ckpt.pt"


async def test_a_failed_part_makes_the_file_go_up_whole(tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    data = os.urandom(3 * PART)
    async with node(config(), store, tmp_path / "node") as p:
        fs = Posix(p.fs)
        store.fail("put", times=1, skip=2)  # create, part 1, then part 2 fails for good
        fh = await fs.create("ckpt.pt")
        await _append(p, fh, data)
        await _wait(lambda: store.calls.get("put", 0) >= 3, "a part failed")
        await fs.close(fh)
        await _wait(lambda: "ckpt.pt" in store.inner.objects, "object complete")
        assert store.inner.objects["ckpt.pt"][0] == data
        assert store.inner.uploads == {}
        assert p.backend.stats().stream_fallbacks == 1


async def test_an_unlinked_file_being_written_leaves_no_upload(tmp_path: Path) -> None:
    store = FaultyStore(MemoryStore())
    async with node(config(), store, tmp_path / "node") as p:
        fs = Posix(p.fs)
        fh = await fs.create("tmp.pt")
        await _append(p, fh, os.urandom(2 * PART + MiB))
        await _wait(lambda: store.inner.calls["upload_part"] >= 2, "parts sent")
        await fs.unlink("tmp.pt")
        await _wait(lambda: not store.inner.uploads, "upload aborted")
        await fs.close(fh)
        assert "tmp.pt" not in store.inner.objects
