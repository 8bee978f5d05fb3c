"""The leader's side of a read barrier without a log entry (objcache/cluster/readindex.py):
when it may answer with an index, and that concurrent readers share one confirmation
round. The whole path (a learner reading from another learner's close) runs on real
daemons in tests/integration/test_scale.py, and under partitions in the fault campaigns."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from objcache.cluster.readindex import LEASE, PROMISE, RENEW_AHEAD, ReadIndex
from tests.helpers.fake_membership import FakeMembership, numbered


class Voters:
    """The other voters, as the leader's term round reaches them: each answers its term
    (None: no answer) after `delay` seconds, and whether it promised (`promise`)."""

    def __init__(self, terms: dict[str, int | None], delay: float = 0.01,
                 promise: bool = True) -> None:
        self.terms = terms
        self.delay = delay
        self.promise = promise
        self.asked = 0

    async def call(self, node: str, msg: dict[str, Any], max_data: int, timeout: float
                   ) -> tuple[dict[str, Any], None] | None:
        assert msg["op"] == "raft_term" and msg["promise"] == PROMISE
        assert isinstance(msg["term"], int)
        self.asked += 1
        await trio.sleep(self.delay)
        term = self.terms.get(node)
        return None if term is None else ({"term": term, "promised": self.promise}, None)


class Leader:
    """A leading member: its term and commit index, what it applied, its last command."""

    addr = "r0"

    def __init__(self, term: int, commit: int) -> None:
        self.term_now, self.commit = term, commit
        self.applied = commit
        self.last = commit
        self.handovers = 0
        self.handing_over = False
        self.promises = True  # whether its own promises hold

    async def promise(self, seconds: float, term: int) -> tuple[int, bool]:
        assert seconds == PROMISE and term == self.term_now
        return self.term_now, self.promises

    def leading(self) -> tuple[int, int] | None:
        return (self.term_now, self.commit) if self.term_now else None

    def members(self) -> list[str]:
        return [f"r{i}" for i in range(5)]

    def applied_index(self) -> int:
        return self.applied

    def last_command(self) -> int:
        return self.last


def _reads(voters: Voters) -> ReadIndex:
    async def wait_applied(index: int, deadline: float) -> None:
        pass
    return ReadIndex(FakeMembership(others=numbered(5)), voters, lambda: None, lambda: "g",  # type: ignore[arg-type]
                     wait_applied)


@asynccontextmanager
async def _leading(voters: Voters, term: int, commit: int
                   ) -> AsyncIterator[tuple[ReadIndex, Leader, trio.Nursery]]:
    """A leader seen for the first time in `term` (no answer yet: nothing of the term is
    known to be committed), whose commit index then rises to `commit` + 1."""
    reads = _reads(voters)
    leader = Leader(term=term, commit=commit)
    async with trio.open_nursery() as nursery:
        reads.bind(nursery)
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]
        leader.commit = leader.applied = leader.last = commit + 1
        yield reads, leader, nursery


async def test_a_new_leader_answers_once_it_has_committed_in_its_term() -> None:
    voters = Voters({f"n{i}": 7 for i in range(1, 5)})
    reads = _reads(voters)
    leader = Leader(term=7, commit=40)
    async with trio.open_nursery() as nursery:
        reads.bind(nursery)
        # Its commit index may still lack entries its predecessor committed: no answer
        # (the reader commits a no-op, which is such an entry) until it has risen.
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]
        leader.commit = leader.applied = 41
        leader.last = 41
        assert await reads._confirmed(leader) == 41  # type: ignore[arg-type]
        # A later term starts over.
        leader.term_now, leader.commit = 8, 50
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]


async def test_no_answer_without_a_majority_of_the_voters_in_its_term() -> None:
    # Two of four others moved to a later term, one does not answer: with the leader, two
    # of five, not a majority (one of them may have elected another leader).
    voters = Voters({"n1": 7, "n2": 8, "n3": 8, "n4": None})
    async with _leading(voters, term=7, commit=40) as (reads, leader, _):
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]
        voters.terms["n4"] = 7  # now three of five
        assert await reads._confirmed(leader) == 41  # type: ignore[arg-type]


async def test_the_index_covers_what_the_leader_applied_once_it_applied_its_commit() -> None:
    voters = Voters({f"n{i}": 3 for i in range(1, 5)})
    async with _leading(voters, term=3, commit=10) as (reads, leader, nursery):
        # Committed through 12 (the last entry is pysyncobj's own, no command), applied
        # through 11 only: the answer waits for the leader to apply, then names its last
        # command entry.
        leader.commit, leader.applied, leader.last = 12, 11, 11

        async def apply_later() -> None:
            await trio.sleep(0.05)
            leader.applied = 12

        nursery.start_soon(apply_later)
        assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]


async def test_concurrent_readers_share_a_round() -> None:
    voters = Voters({f"n{i}": 5 for i in range(1, 5)}, delay=0.05)
    got: list[int | None] = []
    async with _leading(voters, term=5, commit=20) as (reads, leader, _):
        asked = voters.asked

        async def reader() -> None:
            got.append(await reads._confirmed(leader))  # type: ignore[arg-type]

        async with trio.open_nursery() as readers:
            for _ in range(20):
                readers.start_soon(reader)
    assert got == [21] * 20
    # One round for the first reader, one for the 19 that arrived while it ran: two
    # rounds of four questions at most, not twenty.
    assert voters.asked - asked <= 8, voters.asked - asked


async def test_a_silent_voter_is_asked_one_question_at_a_time(autojump_clock: Any) -> None:
    # n4 is cut off and not suspected yet: each round would leave a question waiting on it
    # for TERM_ASK_TIMEOUT, one per read barrier. (No promises: every read has a round.)
    voters = Voters({f"n{i}": 2 for i in range(1, 5)}, promise=False)
    per_voter: dict[str, int] = {}
    call = voters.call

    async def counting(node: str, msg: dict[str, Any], max_data: int, timeout: float
                       ) -> tuple[dict[str, Any], None] | None:
        per_voter[node] = per_voter.get(node, 0) + 1
        if node == "n4":
            await trio.sleep(timeout)
            return None
        return await call(node, msg, max_data, timeout)

    voters.call = counting  # type: ignore[method-assign]
    async with _leading(voters, term=2, commit=9) as (reads, leader, _):
        for _ in range(20):
            assert await reads._confirmed(leader) == 10  # type: ignore[arg-type]
    assert per_voter["n4"] == 1, per_voter


async def test_promises_of_a_majority_make_a_lease(autojump_clock: Any) -> None:
    # Two of four others promised, and the leader did: three of five. Until LEASE after
    # the round began, no other leader can be elected: reads are answered with no round.
    voters = Voters({"n1": 4, "n2": 4, "n3": 5, "n4": None})
    async with _leading(voters, term=4, commit=30) as (reads, leader, _):
        began = trio.current_time()
        assert await reads._confirmed(leader) == 31  # type: ignore[arg-type]
        asked = voters.asked
        leader.commit = leader.applied = leader.last = 33  # (committed meanwhile)
        for _ in range(10):
            assert await reads._confirmed(leader) == 33  # type: ignore[arg-type]
        assert voters.asked == asked and reads.leased == 10
        # Past the lease: a round again.
        await trio.sleep_until(began + LEASE)
        assert await reads._confirmed(leader) == 33  # type: ignore[arg-type]
        assert voters.asked > asked


async def test_no_lease_without_a_majority_of_promises() -> None:
    for voters, own in ((Voters({f"n{i}": 4 for i in range(1, 5)}, promise=False), True),
                        # one promise short: n3's term moved, n4 silent
                        (Voters({"n1": 4, "n2": 4, "n3": 5, "n4": None}), False)):
        async with _leading(voters, term=4, commit=30) as (reads, leader, _):
            leader.promises = own
            if not own:
                voters.terms["n2"] = 5
                voters.terms["n3"] = 4
                voters.terms["n4"] = 4
                voters.promise = True
            for _ in range(3):
                asked = voters.asked
                got = await reads._confirmed(leader)  # type: ignore[arg-type]
                assert voters.asked > asked, "answered under a lease"
            assert reads.leased == 0
            assert got == 31


async def test_a_handover_or_a_new_term_ends_the_lease() -> None:
    voters = Voters({f"n{i}": 6 for i in range(1, 5)})
    async with _leading(voters, term=6, commit=10) as (reads, leader, _):
        assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]
        asked = voters.asked
        assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]
        assert voters.asked == asked
        # RaftNode.step_down began: rounds again, and no promise asked while it runs
        leader.handovers += 1
        leader.handing_over = True
        call = voters.call

        async def no_promise(node: str, msg: dict[str, Any], max_data: int, timeout: float
                             ) -> tuple[dict[str, Any], None] | None:
            assert "promise" not in msg
            voters.asked += 1
            return {"term": voters.terms[node]}, None

        voters.call = no_promise  # type: ignore[method-assign]
        for _ in range(2):
            asked = voters.asked
            assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]
            assert voters.asked > asked
        # It did not hand over (still leading in term 6): a lease again, from a new round.
        leader.handing_over = False
        voters.call = call  # type: ignore[method-assign]
        assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]
        asked = voters.asked
        assert await reads._confirmed(leader) == 11  # type: ignore[arg-type]
        assert voters.asked == asked
        # Elected again in a later term: nothing holds until it has committed in it.
        leader.term_now = 7
        assert await reads._confirmed(leader) is None  # type: ignore[arg-type]


async def test_a_read_near_the_end_renews_the_lease_in_the_background(
        autojump_clock: Any) -> None:
    voters = Voters({f"n{i}": 2 for i in range(1, 5)}, delay=0.01)
    async with _leading(voters, term=2, commit=5) as (reads, leader, _):
        began = trio.current_time()
        assert await reads._confirmed(leader) == 6  # type: ignore[arg-type]
        await trio.sleep_until(began + LEASE - RENEW_AHEAD / 2)
        asked = voters.asked
        # answered at once under the lease; the renewal runs behind it
        assert await reads._confirmed(leader) == 6  # type: ignore[arg-type]
        assert reads.leased == 1
        await trio.sleep(0.05)  # (the renewal's questions and answers)
        assert voters.asked == asked + 4
        await trio.sleep_until(began + LEASE + 0.1)  # the first lease is over...
        asked = voters.asked
        assert await reads._confirmed(leader) == 6  # type: ignore[arg-type]
        assert voters.asked == asked and reads.leased == 2  # ...the renewed one holds
