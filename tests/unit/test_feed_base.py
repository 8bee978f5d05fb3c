"""A member's feed serves only what follows the state it started from: asked for entries
from before that state, it answers with a snapshot, never "no entries, applied through N"
(the asker took that as having applied everything up to N, and skipped the commands in
between for good: a voter demoted to learner was followed by two learners that had not
applied its last commit, and they showed a register one write behind for the rest of the
run; the partition nemesis with learners, seed 4406)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import msgpack

from objcache.cluster.learner import Learner
from objcache.cluster.raftgroup import RaftGroup
from objcache.raft.node import Feed
from tests.helpers.fake_membership import FakeMembership


def test_a_feed_started_from_a_state_hands_out_only_what_follows_it() -> None:
    feed = Feed(max_entries=8, max_bytes=1 << 20, base=40)
    assert feed.since(30, 1 << 20) is None  # from before the state: a snapshot
    assert feed.since(40, 1 << 20) == []  # nothing new yet
    with feed.lock:
        feed.add(41, b"e41")
    assert [i for i, _ in feed.since(40, 1 << 20) or []] == [41]
    assert feed.since(39, 1 << 20) is None
    with feed.lock:
        feed.reset(50)  # a snapshot at 50 replaced the state
    assert feed.since(41, 1 << 20) is None and feed.since(50, 1 << 20) == []


async def _ask(g: RaftGroup[Any], after: int) -> tuple[dict[str, Any], Any]:
    reply, data = await g._feed("n1", {"after": after, "wait": 0.2, "linger": 0.0})
    return reply, data


async def test_a_learner_that_starts_from_its_own_state_answers_older_askers_with_a_snapshot(
        tmp_path: Path) -> None:
    state = {"k": "v"}
    g: RaftGroup[Any] = RaftGroup(FakeMembership(), None, None, "r0",  # type: ignore[arg-type]
                                  tmp_path / "g", "k" * 32, dict, lambda m, c: None)

    async def wait_applied(index: int, deadline: float, active: bool) -> None:
        pass

    learner = Learner(None, FakeMembership(), state, ["r1"], "",  # type: ignore[arg-type]
                      lambda s, c, i: None, wait_applied, lambda i: None, applied=40)
    g._current = learner
    reply, data = await _ask(g, 30)
    assert reply.get("snapshot") and reply["through"] == 40
    assert pickle.loads(bytes(data)) == state
    # One that has applied as much waits, and hears of nothing new.
    reply, data = await _ask(g, 40)
    assert not reply.get("snapshot") and msgpack.unpackb(bytes(data)) == []
    assert reply["through"] == 40
