"""A learner sends its commands through the voter it follows; when that voter could not
commit them (no leader: cut off from it, while the learner is not), the next try goes to
another voter for a second, instead of failing every command and read barrier through
the same one for as long as its cut lasts. With every voter failing (an election), it
goes on asking the one it follows."""

from __future__ import annotations

from typing import Any

import pytest

from objcache.cluster.learner import SUBMIT_AVOID_SECONDS, Learner
from objcache.errors import NoQuorum
from tests.helpers.fake_membership import FakeMembership, numbered


class Client:
    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.asked: list[str] = []

    async def call(self, node: str, msg: dict[str, Any], **kw: Any) -> Any:
        assert msg["op"] == "raft_submit"
        self.asked.append(node)
        if node in self.failing:
            return None  # ("could not serve 'raft_submit': missing leader")
        return {"results": [True] * len(msg["cmds"]), "index": 7}, None


async def _wait(index: int, deadline: float, active: bool) -> None:
    pass


def _learner(client: Client) -> Learner:
    learner = Learner(client, FakeMembership("n9", others=numbered(3)), {}, ["r0", "r1", "r2"], "g",  # type: ignore[arg-type]
                      lambda s, c, i: None, _wait, lambda i: None)
    learner.leader = "r0"
    learner.source = "n1"  # the voter it follows (not the leader)
    return learner


async def test_a_command_the_followed_voter_could_not_commit_goes_to_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client({"n1"})
    learner = _learner(client)
    with pytest.raises(NoQuorum):
        await learner._send_batch([b"c1"], 5.0)
    assert (await learner._send_batch([b"c2"], 5.0))[1] == 7
    assert client.asked[0] == "n1" and client.asked[1] in ("n0", "n2")
    assert learner.source == "n1"  # the log still comes from it

    # A second later the followed voter is asked first again.
    now = __import__("time").monotonic()
    monkeypatch.setattr("objcache.cluster.learner.time.monotonic",
                        lambda: now + SUBMIT_AVOID_SECONDS + 0.1)
    client.failing.clear()
    await learner._send_batch([b"c3"], 5.0)
    assert client.asked[-1] == "n1"


async def test_with_every_voter_failing_it_asks_the_one_it_follows() -> None:
    client = Client({"n0", "n1", "n2"})
    learner = _learner(client)
    for _ in range(5):
        with pytest.raises(NoQuorum):
            await learner._send_batch([b"c"], 5.0)
    assert client.asked[:3] != ["n1"] * 3 and client.asked[-1] == "n1"
    assert set(client.asked) == {"n0", "n1", "n2"}
