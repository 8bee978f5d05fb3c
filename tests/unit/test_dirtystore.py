"""Blobs of objcache/txn/dirtystore.py: a holder that fails midway fails the pull with its
own error, leaves no partial blob, and the next pull works; a blob sealed as a hard link
gets a file of its own before its working copy changes; a blob whose commit this node made
goes at the first gc after its entry is written back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.errors import PeerError
from objcache.txn.dirtystore import DirtyStore


async def test_a_failed_pull_raises_the_holders_error_and_leaves_nothing(tmp_path: Path
                                                                         ) -> None:
    ds = DirtyStore(tmp_path, lambda n: True, lambda n: None)
    data = os.urandom(3 << 20)

    async def failing(off: int, view: memoryview) -> None:
        part = view[:16]  # a view of the pull's buffer, still referenced by the traceback
        part[:] = data[off:off + 16]
        raise PeerError("the holder went away")

    with pytest.raises(PeerError, match="went away"):
        await ds.pull("c0ffee", len(data), failing)
    assert not ds.has("c0ffee")
    assert [p.name for p in ds.root.iterdir()] == []

    async def good(off: int, view: memoryview) -> None:
        view[:] = data[off:off + len(view)]

    await ds.pull("c0ffee", len(data), good)
    assert ds.has("c0ffee")
    assert await trio.Path(ds.path("c0ffee")).read_bytes() == data



def _read(path: str | Path) -> bytes:
    return Path(path).read_bytes()


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _poke(path: Path, data: bytes) -> None:
    """Write `data` at the start of the file, in place (its inode stays)."""
    with open(path, "r+b") as f:
        f.write(data)

async def test_a_linked_blob_gets_its_own_file_before_the_working_copy_changes(
        tmp_path: Path) -> None:
    """A blob sealed as a hard link to a working copy the kernel writes without us is
    given a copy of its own before the next writer (DirtyStore.detach): kept when it still
    holds the committed bytes, dropped (this node holds it no more) when something wrote
    the file after its close."""
    ds = DirtyStore(tmp_path, lambda n: True, lambda n: None)
    work = tmp_path / "working"
    one = os.urandom(1 << 20)
    work.write_bytes(one)

    def check(expected: bytes):  # type: ignore[no-untyped-def]
        async def fn(path: str) -> bool:
            return _read(path) == expected
        return fn

    ds.seal("b1", str(work), len(one))
    assert os.stat(ds.path("b1")).st_ino == os.stat(work).st_ino  # no copy at close
    await ds.detach("b1", str(work), check(one))
    assert os.stat(ds.path("b1")).st_ino != os.stat(work).st_ino
    _poke(work, b"written again")
    assert _read(ds.path("b1")) == one
    await ds.detach("b1", str(work), check(one))  # detached already: nothing to do
    assert ds.has("b1")

    # Written after the close, behind our back (a shared mapping): the blob is dropped.
    work.write_bytes(one)
    ds.seal("b2", str(work), len(one))
    _poke(work, b"through a mapping")
    await ds.detach("b2", str(work), check(one))
    assert not ds.has("b2") and not _exists(ds.path("b2"))
    assert sorted(p.name for p in ds.root.iterdir()) == ["b1"]  # no copy left behind


async def test_a_read_racing_the_detach_of_a_linked_blob_reads_the_blob(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that opened a linked blob's name before `detach` renamed the copy over it,
    and read after the writer truncated the working copy, returned no bytes: a peer's read
    of a register gave an empty file (the partition nemesis, 5 nodes, seed 2127)."""
    ds = DirtyStore(tmp_path, lambda n: True, lambda n: None)
    work = tmp_path / "working"
    one = os.urandom(1 << 16)
    work.write_bytes(one)
    ds.seal("b1", str(work), len(one))
    pread, raced = os.pread, []

    def detach_then_pread(fd: int, n: int, off: int) -> bytes:
        if not raced:  # between the read's open and its pread: detach, then truncate
            raced.append(True)
            trio.from_thread.run(ds.detach, "b1", str(work), _same_as(one))
            os.truncate(work, 0)
        return pread(fd, n, off)

    monkeypatch.setattr(os, "pread", detach_then_pread)
    assert await ds.read("b1", 100, 1000) == one[100:1100]
    assert raced


def _same_as(expected: bytes):  # type: ignore[no-untyped-def]
    async def fn(path: str) -> bool:
        return _read(path) == expected
    return fn


def test_a_blob_committed_here_goes_at_the_first_gc_once_written_back(tmp_path: Path
                                                                      ) -> None:
    """The writer's blob, committed and then written back before any gc pass saw its entry
    (a fast upload in a crowded cache): the next gc drops it, freeing the room a writer
    waits for. A blob pulled for a commit still on its way keeps its grace. (Before
    `committed_here`, both were kept for KEEP_UNREFERENCED: the CI flake of
    test_checkpoints_bigger_than_the_cache_wait_for_write_back[replicated].)"""
    freed: list[int] = []
    ds = DirtyStore(tmp_path, lambda n: True, freed.append)
    for cid in ("mine", "pending"):
        work = tmp_path / f"{cid}.work"
        work.write_bytes(b"x" * 4096)
        ds.seal(cid, str(work), 4096)
    ds.committed_here("mine")
    assert ds.gc(referenced=set()) == 1  # "mine" was written back: nothing refers to it
    assert not ds.has("mine") and ds.has("pending")
    assert freed == [4096]
