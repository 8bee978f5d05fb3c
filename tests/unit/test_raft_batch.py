"""The raft layer's group commit and log feed (objcache/raft/node.py), without pysyncobj:
commands submitted together share one log entry, a lone one goes at once, a failed batch
fails each of its commands (their callers resubmit them), a batch entry applies its
commands in order with their own results, and the feed hands a follower the entries after
its index or tells it to take a snapshot."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import trio

from objcache.errors import NoQuorum
from objcache.raft.node import Batcher, Feed, apply_entry, pack
from objcache.txn.state import ClusterState


class Log:
    """A fake log: each batch becomes one entry after `delay` seconds."""

    def __init__(self, delay: float = 0.01, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail
        self.entries: list[list[bytes]] = []

    async def send(self, blobs: list[bytes], timeout: float) -> tuple[list[Any], int]:
        await trio.sleep(self.delay)
        if self.fail:
            raise NoQuorum("no leader")
        self.entries.append(blobs)
        return [msgpack.unpackb(b)["n"] for b in blobs], len(self.entries) + 1


async def test_a_lone_command_goes_at_once_alone(autojump_clock: Any) -> None:
    log = Log()
    t0 = trio.current_time()
    results, index = await Batcher(log.send).submit([pack({"n": 1})], 5)
    assert results == [1] and index == 2 and len(log.entries) == 1
    assert trio.current_time() - t0 == pytest.approx(0.01)


async def test_commands_submitted_together_share_entries(autojump_clock: Any) -> None:
    log = Log()
    batcher = Batcher(log.send, in_flight=2)
    got: dict[int, Any] = {}

    async def one(n: int) -> None:
        got[n] = await batcher.submit([pack({"n": n})], 5)

    async with trio.open_nursery() as nursery:
        for n in range(100):
            nursery.start_soon(one, n)
    assert sorted(r[0][0] for r in got.values()) == list(range(100))  # each its own result
    assert len(log.entries) <= 4, [len(e) for e in log.entries]  # not 100 entries
    assert batcher.commands == 100


async def test_a_failed_batch_fails_each_command(autojump_clock: Any) -> None:
    batcher = Batcher(Log(fail=True).send)
    errors = []

    async def one(n: int) -> None:
        try:
            await batcher.submit([pack({"n": n})], 5)
        except NoQuorum as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(one, n)
    assert len(errors) == 10


async def test_a_command_that_waits_too_long_is_abandoned(autojump_clock: Any) -> None:
    log = Log(delay=10.0)
    batcher = Batcher(log.send, in_flight=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.submit, [pack({"n": 0})], 30)  # holds the one slot
        await trio.sleep(0.1)
        with pytest.raises(NoQuorum):
            await batcher.submit([pack({"n": 1})], 1)  # queued behind it, gives up
    assert [len(e) for e in log.entries] == [1]  # the abandoned one was never sent


def test_a_batch_entry_applies_its_commands_in_order() -> None:
    state = ClusterState()
    seen: list[tuple[str, int]] = []
    cmds = [{"op": "member", "node": "a", "addr": "x:1", "cap": 1, "tx": "t1"},
            {"op": "member", "node": "a", "addr": "x:1", "cap": 1, "tx": "t1"},  # a retry
            {"op": "bogus"}]
    entry = msgpack.packb([pack(c) for c in cmds], use_bin_type=True)
    out = apply_entry(state, entry, 7, lambda m, c, i: seen.append((c["op"], i)))
    assert out[0] == out[1] == {"ok": True} and "error" in out[2]
    assert state.applied == 2  # the retry returned the first result without applying
    assert seen == [("member", 7), ("member", 7), ("bogus", 7)]
    assert apply_entry(state, pack(cmds[0]), 8, lambda *a: None) == {"ok": True}


def test_the_feed_hands_out_what_follows_or_asks_for_a_snapshot() -> None:
    feed = Feed(max_entries=4, max_bytes=1 << 20)
    with feed.lock:
        for idx in (5, 6, 8, 9):  # 7 was no command (a no-op, a membership change)
            feed.add(idx, b"e%d" % idx)
    assert feed.base == 4
    assert [i for i, _ in feed.since(4, 1 << 20) or []] == [5, 6, 8, 9]
    assert [i for i, _ in feed.since(6, 1 << 20) or []] == [8, 9]
    assert feed.since(9, 1 << 20) == []
    assert feed.since(3, 1 << 20) is None  # from before what it holds: a snapshot
    assert [i for i, _ in feed.since(4, 4) or []] == [5, 6]  # bounded (at least one)
    with feed.lock:
        feed.add(10, b"e10")  # over max_entries: the oldest goes
    assert feed.base == 5 and feed.since(4, 1 << 20) is None
    assert [i for i, _ in feed.since(5, 1 << 20) or []] == [6, 8, 9, 10]


async def test_a_command_that_timed_out_in_the_queue_was_never_sent(autojump_clock: Any
                                                                    ) -> None:
    """Whether a timed-out command may be in the log decides between EIO and settling
    it by a fence (objcache.txn.coordinator): one still queued behind a slow batch is
    in no log; one whose batch was on its way may be."""
    batcher = Batcher(Log(delay=10).send, in_flight=1)
    errors: dict[str, NoQuorum] = {}

    async def one(name: str, timeout: float) -> None:
        with pytest.raises(NoQuorum) as e:
            await batcher.submit([pack({"n": 1})], timeout)
        errors[name] = e.value

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "sent", 3)
        await trio.sleep(0.5)
        nursery.start_soon(one, "queued", 1)
    assert errors["sent"].maybe_sent
    assert not errors["queued"].maybe_sent
