"""A learner changes its state one answer at a time. Entries come in feed, submit and
read-index answers, and an apply pauses between slices of APPLY_SLICE entries; a snapshot
installed in such a pause set `applied` back below what the paused apply had reached, and
that apply went on from where it was, so the entries in between were never applied (the
partition nemesis with learners, seed 5706: a node showed two files as they were before
their rename and unlink, for good)."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import trio

from objcache.cluster.learner import APPLY_SLICE, Learner
from tests.helpers.fake_membership import FakeMembership


class Seen:
    """A state machine that records the commands it applied."""

    def __init__(self, upto: int = 0) -> None:
        self.seen = list(range(1, upto + 1))

    def apply(self, cmd: dict[str, Any]) -> None:
        self.seen.append(cmd["i"])


def _packed(first: int, last: int) -> bytes:
    return msgpack.packb([(i, msgpack.packb({"i": i})) for i in range(first, last + 1)])


async def _wait(index: int, deadline: float, active: bool) -> None:
    pass


def _learner(applied_hook: trio.Event, at: int) -> Learner:
    state = Seen()

    def on_applied(s: Any, cmd: Any, index: int) -> None:
        if index == at:
            applied_hook.set()

    return Learner(None, FakeMembership(), state, ["r0"], "g",  # type: ignore[arg-type]
                   on_applied, _wait, lambda i: None)


async def test_a_snapshot_during_an_apply_loses_no_entry() -> None:
    last = APPLY_SLICE * 40  # (many pauses: the apply cannot end before the snapshot comes)
    paused = trio.Event()
    learner = _learner(paused, APPLY_SLICE)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(learner.take, _packed(1, last), last, "g")
        await paused.wait()  # the apply is at its first pause
        # A feed answer asked before: a snapshot of the state at index 10
        await learner._take({"snapshot": True, "through": 10, "group": "g"},
                            pickle.dumps(Seen(10)))
    assert learner.applied == last
    assert learner.state.seen == list(range(1, last + 1))


async def test_a_snapshot_newer_than_what_was_applied_is_taken() -> None:
    learner = _learner(trio.Event(), 0)
    await learner.take(_packed(1, 5), 5, "g")
    await learner._take({"snapshot": True, "through": 50, "group": "g"},
                        pickle.dumps(Seen(50)))
    assert learner.applied == 50 and learner.state.seen == list(range(1, 51))
    await learner.take(_packed(40, 60), 60, "g")  # (an answer from before it: the rest)
    assert learner.state.seen == list(range(1, 61))
    # One of another group replaces the state whatever its index
    await learner._take({"snapshot": True, "through": 7, "group": "h"}, pickle.dumps(Seen(7)))
    assert learner.group == "h" and learner.applied == 7 and learner.state.seen == [
        *range(1, 8)]
