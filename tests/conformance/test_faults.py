"""The core over a failing object store, on both backends: calls fail with EIO or wait, and
nothing acknowledged is lost, nothing half-applied is shown, no wrong byte is served.

The store wrapper (tests/helpers/inproc.FaultyStore) fails the Nth call of an operation
the way the real store reports a failure after its own retries (StoreUnavailable), stalls
calls, or returns a short body (a store breaking its contract)."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from objcache.cache.quarantine import Quarantine
from objcache.entries import FlushScope
from objcache.errors import ObjcacheError, StoreError
from tests.conformance.conftest import Env
from tests.helpers.inproc import FaultyStore, MiB, Posix, cluster, config, node
from tests.helpers.memstore import MemoryStore


async def _flush_until_done(env: Env, attempts: int = 3) -> None:
    """flush either writes everything back or fails with EIO; asked again after the
    store recovered, it finishes."""
    for i in range(attempts):
        try:
            with trio.fail_after(20):
                await env.a.fs.flush_scope(FlushScope.everything())
            return
        except ObjcacheError as e:
            assert e.errno == errno.EIO and i < attempts - 1, e


async def test_failed_uploads_lose_nothing(env: Env) -> None:
    data = os.urandom(2 * MiB + 5)
    await env.a.write("f", data)
    env.store.fail("put", times=1)
    await _flush_until_done(env)
    assert env.objects["f"][0] == data
    assert await env.b.read("f") == data


async def test_a_short_body_is_an_error_never_wrong_bytes(env: Env) -> None:
    data = os.urandom(3 * MiB)
    env.put("obj", data)
    env.store.short("get", times=2)
    try:  # the bodies that ended early were readahead's, or the reader's own
        assert await env.b.read("obj") == data
    except ObjcacheError as e:
        assert e.errno == errno.EIO
    assert env.store.faults[0].hits >= 1
    env.store.clear()
    assert await env.b.read("obj") == data  # nothing short was cached
    assert await env.a.read("obj") == data


async def test_a_failed_lookup_is_eio_then_works(env: Env) -> None:
    env.put("x", b"x")
    env.store.fail("head", times=1)
    with pytest.raises(ObjcacheError) as e:
        await env.a.read("x")
    assert e.value.errno == errno.EIO
    assert await env.a.read("x") == b"x"


async def test_a_failed_change_is_whole_or_not_at_all(env: Env) -> None:
    """unlink and rename while S3 deletes and copies fail: either the call fails and
    nothing changed, or it succeeded and S3 matches after write-back."""
    env.put("u", b"u")
    for i in range(4):
        env.put(f"dir/f{i}", str(i).encode())
    await env.a.read("u")
    await env.a.listdir("dir")
    env.store.fail("delete", times=1)
    env.store.fail("copy", times=1, skip=2)
    for call, gone, there in ((env.a.unlink("u"), ["u"], []),
                              (env.a.rename("dir", "moved"), ["dir"], ["moved"])):
        try:
            await call
        except ObjcacheError as e:
            assert e.errno == errno.EIO
            continue  # (a directory rename on one node is not atomic: see semantics)
        await env.b.fs.sync()
        for p in gone:
            assert not await env.b.exists(p), p
        for p in there:
            assert await env.b.exists(p), p
    env.store.clear()
    if await env.a.exists("dir"):
        # One node moves a directory object by object: a failure leaves each file at
        # exactly one of the two names; moving the rest finishes it.
        left = set(await env.a.listdir("dir"))
        arrived = set(await env.a.listdir("moved")) if await env.a.exists("moved") else set()
        assert env.kind == "local" and left | arrived == {f"f{i}" for i in range(4)}
        assert not left & arrived
        if not arrived:
            await env.a.rename("dir", "moved")
        for name in left - arrived:
            await env.a.rename(f"dir/{name}", f"moved/{name}")
    if await env.a.exists("u"):
        await env.a.unlink("u")
    await _flush_until_done(env)
    keys = set(env.objects)
    assert "u" not in keys and not any(k.startswith("dir/") for k in keys)
    assert {f"moved/f{i}" for i in range(4)} <= keys
    assert await env.b.read("moved/f3") == b"3"


async def test_a_stalled_read_blocks_nothing_else(env: Env) -> None:
    env.put("slow", os.urandom(MiB))
    env.put("fast", b"fast")
    await env.a.stat("slow")
    await env.a.stat("fast")
    env.store.stall("get", 2.0, times=1)
    done: list[float] = []

    async def slow() -> None:
        await env.a.read("slow")
        done.append(time.monotonic())

    async with trio.open_nursery() as n:
        t0 = time.monotonic()
        n.start_soon(slow)
        await trio.sleep(0.1)
        assert await env.a.listdir("") == ["fast", "slow"]
        await env.a.write("new", b"n")
        assert await env.a.read("new") == b"n"
        assert time.monotonic() - t0 < 1.5  # none of it waited for the stalled GET
    assert done and done[0] - t0 >= 2.0


async def test_a_key_s3_refuses_for_good_is_quarantined_and_flush_finishes(
        env: Env, tmp_path: Path) -> None:
    """A permanent refusal (a 4xx) of one key: flush uploads everything else, moves the
    refused file's bytes to lost+found/ with a note, and fails naming it; nothing is
    deleted, and a second flush has nothing left to do."""
    env.store.refuse("bad.bin")
    data = os.urandom(MiB + 3)
    await env.a.write("good.bin", b"good")
    await env.a.write("bad.bin", data)
    await env.a.write("also-good.bin", b"also")
    with trio.fail_after(30), pytest.raises(StoreError) as e:
        await env.a.fs.flush_scope(FlushScope.everything())
    assert "'bad.bin'" in str(e.value) and "lost+found" in str(e.value)
    assert env.objects["good.bin"][0] == b"good"
    assert env.objects["also-good.bin"][0] == b"also"
    assert "bad.bin" not in env.objects
    notes = list(tmp_path.rglob("lost+found/*.json"))  # noqa: ASYNC240
    assert len(notes) == 1
    note = json.loads(notes[0].read_text())
    assert note["key"] == "bad.bin" and "refuses" in note["error"]
    assert (notes[0].parent / note["data"]).read_bytes() == data
    with trio.fail_after(10):
        await env.a.fs.flush_scope(FlushScope.everything())  # nothing dirty is left
    assert env.a.fs.backend.stats().quarantined == 1
    assert env.a.fs.backend.stats().dirty_files == 0


async def test_a_flush_fails_for_a_file_it_quarantined_while_the_note_was_being_written(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quarantine drops the entry before it writes its note (an fsync): a flush that
    saw nothing dirty meanwhile returned as if the refused file had gone up (a clean-clone
    CI run with the disk busy)."""
    write_note = Quarantine._note

    def slow_note(*args: object) -> None:
        time.sleep(0.5)  # (on the quarantine's thread) a disk busy with others' fsyncs
        write_note(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(Quarantine, "_note", staticmethod(slow_note))
    env.store.refuse("bad.bin")
    await env.a.write("bad.bin", b"refused")
    with trio.fail_after(30), pytest.raises(StoreError, match="'bad.bin'"):
        await env.a.fs.flush_scope(FlushScope.everything())


@pytest.mark.parametrize("kind", ["local", "replicated"])
async def test_a_refused_key_is_retried_then_quarantined_in_the_background(
        kind: str, tmp_path: Path) -> None:
    """Without a flush, write-back retries a refused file a few times, then quarantines
    it: it never retries forever."""
    store = FaultyStore(MemoryStore())
    store.refuse("bad.bin")
    async with AsyncExitStack() as stack:
        if kind == "local":
            p = await stack.enter_async_context(node(config(writeback_delay=0.2), store,
                                                     tmp_path / "n"))
            nodes = [p]
        else:
            nodes = list(await stack.enter_async_context(
                cluster(store, tmp_path, 2, writeback_delay=0.2)))
        a, b = Posix(nodes[0].fs), Posix(nodes[-1].fs)
        await a.write("bad.bin", b"refused bytes")
        await a.write("good.bin", b"good")
        t0 = time.monotonic()
        with trio.fail_after(30):
            while not list(tmp_path.rglob("lost+found/*.json")):  # noqa: ASYNC240
                await trio.sleep(0.1)
        assert time.monotonic() - t0 >= 0.5 * 2  # three refusals, 0.5 s apart at least
        await b.fs.sync()
        assert not await b.exists("bad.bin")  # the name shows S3's (no) version again
        assert sum(n.backend.stats().quarantined for n in nodes) == 1
        assert store.inner.objects["good.bin"][0] == b"good"


async def _listing_on_b_during(env: Env, change: Callable[[Env], Awaitable[None]]
                               ) -> list[str]:
    """B lists "d" with a LIST whose answer arrives 0.5 s after S3 read it; `change` runs
    on A meanwhile. What the listing showed."""
    env.store.lag("list", 0.5)
    names: list[str] = []

    async def lister() -> None:
        names.extend(await env.b.listdir("d"))

    async with trio.open_nursery() as n:
        n.start_soon(lister)
        await trio.sleep(0.1)
        await change(env)
    return names


async def _flush_one(env: Env) -> None:
    assert await env.flush() >= 1


async def test_a_listing_shows_a_file_whose_write_back_finished_while_it_ran(env: Env
                                                                             ) -> None:
    """S3's LIST answers what it held when it read: a file uploaded just after that has
    left the namespace overlay by the time the answer arrives. The listing still shows it,
    and again when asked later."""
    await env.a.mkdir("d")
    await env.a.write("d/old", b"o")
    await env.flush()
    await env.a.write("d/f", b"acknowledged")
    await env.settle()
    names = await _listing_on_b_during(env, _flush_one)  # uploaded, gone from the overlay
    assert "d/f" in env.objects
    assert sorted(names) == ["f", "old"]
    assert sorted(await env.b.listdir("d")) == ["f", "old"]
    assert await env.b.read("d/f") == b"acknowledged"


async def test_a_directory_renamed_while_it_is_listed_is_never_listed_empty(env: Env
                                                                          ) -> None:
    """A renames "d" while B's listing of it waits for the LIST: B shows the whole
    directory or no directory, never an empty one (B's inode for "d" is detached when A's
    rename applies, and the listing under the old name found nothing)."""
    await env.a.mkdir("d")
    for i in range(5):
        await env.a.write(f"d/f{i}", b"x")
    await env.settle()
    await env.b.ino("d")  # B knows the directory, not yet its listing

    env.store.lag("list", 0.5)
    shown: list[list[str] | int] = []

    async def lister() -> None:
        try:
            shown.append(sorted(await env.b.listdir("d")))
        except ObjcacheError as e:
            shown.append(e.errno)

    async with trio.open_nursery() as n:
        n.start_soon(lister)
        await trio.sleep(0.1)
        await env.a.rename("d", "e")
        await env.settle()
    assert shown in ([[f"f{i}" for i in range(5)]], [errno.ENOENT]), shown
    assert sorted(await env.b.listdir("e")) == [f"f{i}" for i in range(5)]
    assert not await env.b.exists("d")


async def test_a_listing_hides_a_file_deleted_while_it_ran(env: Env) -> None:
    """The other way round: an object deleted from S3 while the LIST's answer travelled
    (its tombstone gone with it) is not shown, then or later."""
    await env.a.mkdir("d")
    await env.a.write("d/old", b"o")
    await env.a.write("d/gone", b"g")
    await env.flush()
    await env.b.stat("d/gone")  # known to B, its directory not listed yet
    async def remove(env: Env) -> None:
        await env.a.unlink("d/gone")
        await env.flush()

    await _listing_on_b_during(env, remove)
    assert "d/gone" not in env.objects
    assert sorted(await env.b.listdir("d")) == ["old"]
    assert not await env.b.exists("d/gone")


async def test_a_file_created_elsewhere_during_a_first_listing_is_in_it(env: Env) -> None:
    """A directory listed for the first time on B while A creates a file in it: the file
    is in B's listing (then cached), whichever side of the listing's reads it fell."""
    await env.a.mkdir("d")
    await env.a.write("d/up", b"u")
    await env.settle()
    await env.b.ino("d")
    env.store.lag("list", 0.4)
    env.store.stall("head", 0.6)  # settling "up" (uploaded meanwhile) takes a while
    async with trio.open_nursery() as n:
        n.start_soon(env.b.listdir, "d")
        await trio.sleep(0.1)
        await env.flush()
        await trio.sleep(0.5)  # the LIST answered; its HEAD is pending
        await env.a.write("d/new", b"n")
        await env.settle()
    assert sorted(await env.b.listdir("d")) == ["new", "up"]


async def test_a_slow_write_of_an_older_version_never_lands_over_a_newer_one(
        env: Env) -> None:
    """Two nodes writing one key back at once (a flush on each: each uploads what it
    can): A's PUT of the file's first version (empty, created) is slow; meanwhile the
    file is closed with its bytes and B writes that version back. S3 must end up with
    the bytes, never with A's late empty PUT over them."""
    if env.kind == "local":
        pytest.skip("one node writes back alone")
    fh = await env.a.create("f")
    env.store.stall("put", 4.0, times=1)
    async with trio.open_nursery() as n:
        n.start_soon(env.a.fs.flush_scope, FlushScope.under(""))
        await trio.sleep(0.3)  # A's PUT of the empty version is on its way
        await env.a.fs.write(fh, 0, b"acknowledged bytes")
        await env.a.close(fh)
        await env.settle()
        n.start_soon(env.b.fs.flush_scope, FlushScope.under(""))
    await env.b.fs.flush_scope(FlushScope.under(""))
    await trio.sleep(4.2)  # A's slow PUT has landed (or never started) by now
    assert env.objects["f"][0] == b"acknowledged bytes"
    assert await env.b.read("f") == b"acknowledged bytes"
