"""This node's place in the cluster's one Raft group: getting in, staying in, leaving.

A starting node asks a member for its group's members, starts its own Raft member with
them as partners (pysyncobj needs the new node running before the change can commit),
then asks any member to add it (forwarded to the leader). A node with nobody to ask forms
a group of one. Nodes started at the same moment (a DaemonSet rollout) may each have
formed a group of one: a lone node that still holds only its start-up entries and sees a
larger group, or a lone node with a lower id, discards its group and joins that one, so
the cluster converges on one group. A node that joins a group with an empty log (a new
node, or one whose cache dir was wiped) neither votes nor stands for election until it
has caught up with the leader (objcache/raft/follower_fix.py). A node that leaves cleanly
is removed by the leader (a leader cannot remove itself; its successor does). A crashed
node stays in the group and rejoins with its journal when restarted.

What the state machine is, and what applying a command means to this node's caches, is
the caller's (objcache.txn): commands applied on pysyncobj's thread are handed to the trio
thread through the `applied` feed, in log order.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from objcache.cluster.membership import ALIVE, LEFT, Member
from objcache.cluster.peers import field_str, split_addr
from objcache.errors import NoQuorum, PeerError, ProtocolError
from objcache.raft.node import RaftNode, StateMachine

if TYPE_CHECKING:
    from objcache.cluster.client import PeerClient
    from objcache.cluster.membership import Membership
    from objcache.cluster.peers import Handler, PeerPool, Reply

log = logging.getLogger(__name__)

LONE_GROUP_ENTRIES = 8  # a Raft group of one this short holds only its own start-up
CATCH_UP_WAIT = 60.0  # mount after this long even if the log is not caught up yet
T = TypeVar("T")


class AppliedFeed(Generic[T]):
    """What the Raft member applied, for the trio thread, in log order: `put` (run by
    pysyncobj's thread through `run_sync_soon`, whose callbacks run in order) appends,
    `take` returns everything so far, and `wait` returns once there is something without
    taking it. (A trio memory channel hands an item to a receiver that waits for it
    directly: until that task runs, the item is in no buffer, and a `take` by another
    task (a read barrier that returned at the same moment) applied the changes after it
    first. A node catching up with the log after a cut applied an unlink before the
    rename that made the name, and listed the unlinked name for good: the partition
    nemesis, seed 2116.)"""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._lot = trio.lowlevel.ParkingLot()

    def put(self, item: T) -> None:
        self._items.append(item)
        self._lot.unpark_all()

    def take(self) -> list[T]:
        items, self._items = self._items, []
        return items

    async def wait(self) -> None:
        while not self._items:
            await self._lot.park()


class RaftGroup(Generic[T]):
    """Attributes:
    ready: a first barrier passed: our member has applied the cluster's log (what we show
        is not a stale or empty view).
    applied: what `extract` took from each applied command, in log order (trio thread).
    """

    def __init__(self, membership: Membership, client: PeerClient, pool: PeerPool,
                 raft_addr: str, raft_dir: Path, secret: str,
                 new_state: Callable[[], StateMachine],
                 extract: Callable[[Any, dict[str, Any]], T | None],
                 catch_up_wait: float = CATCH_UP_WAIT) -> None:
        self.catch_up_wait = catch_up_wait
        self.membership = membership
        self.client = client
        self.pool = pool
        self.addr = raft_addr
        self.dir = raft_dir
        self.secret = secret
        self.new_state = new_state
        self.extract = extract
        self.raft: RaftNode | None = None
        self._closed = False
        self.ready = False
        self.applied = AppliedFeed[T]()
        self._token: trio.lowlevel.TrioToken | None = None

    def routes(self) -> dict[str, Handler]:
        return {"raft_members": self._members, "raft_add": self._change,
                "raft_remove": self._change}

    @property
    def state(self) -> Any:
        """The replicated state as this member has applied it (None before it runs)."""
        return self.raft.state if self.raft is not None else None

    # -- running --------------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Enter the group, then wait (bounded) until we have caught up with its log."""
        self._token = trio.lowlevel.current_trio_token()
        await self._enter_group()
        nursery.start_soon(self._supervise)
        if not await self._catch_up(self.catch_up_wait):
            log.warning("could not catch up with the cluster's log in %.0fs; mounting anyway "
                        "(changes appear as they are applied; write-back waits until "
                        "caught up)", self.catch_up_wait)
            nursery.start_soon(self._catch_up, math.inf)

    async def _catch_up(self, timeout: float) -> bool:
        """Until a barrier passes through the log (then `ready`), at most `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.raft is not None:
                try:
                    await self.raft.submit({"op": "ns.noop"}, timeout=5)
                    self.ready = True
                    log.info("caught up with the cluster's log in %.2fs",
                             time.monotonic() - t0)
                    return True
                except NoQuorum as e:
                    log.info("waiting for the cluster's log: %s", e)
            await trio.sleep(0.2)
        return False

    def _applied(self, machine: Any, cmd: dict[str, Any]) -> None:
        """On pysyncobj's thread: hand what the command changed to the trio thread."""
        item = self.extract(machine, cmd)
        token = self._token
        if item is None or token is None:
            return
        try:
            token.run_sync_soon(self.applied.put, item)
        except trio.RunFinishedError:
            pass

    def _start_raft(self, partners: list[str], joining: bool = False,
                    wiped: bool = False) -> None:
        """Start our Raft member. The partners it starts with are saved: pysyncobj's
        journal records membership changes relative to them, so a restart with the same
        cache dir must start from the same list. `joining`: our log is empty and the
        group's is not; we do not vote until caught up. `wiped`: the group counts our
        address as a voter already; we do not count toward a commit until caught up."""
        saved = self.dir / "partners.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(partners))
        self.raft = RaftNode(self.addr, partners, self.dir, self.secret, self.new_state(),
                             self._applied, joining=joining, wiped=wiped)
        log.info("raft member %s started with partners %s", self.addr, partners or "none")

    def _best_group(self) -> Member | None:
        """The member whose Raft group to join: the largest group, then the lowest id."""
        others = [m for m in self.membership.members.values()
                  if m.state == ALIVE and m.raft and m.raft_n >= 1]  # 0: not started yet
        return min(others, key=lambda m: (-m.raft_n, m.id), default=None)

    async def _ask_to_add(self, first: Member) -> list[str] | None:
        """Have a member add us to its group; its members (us included) if it did."""
        others = [m for m in self.membership.members.values()
                  if m.state == ALIVE and m.raft and m is not first]
        for m in [first, *others]:
            got = await self.client.call(m.id, {"op": "raft_add", "raft": self.addr},
                                         max_data=0, timeout=30.0)
            members = None if got is None else got[0].get("members")
            if isinstance(members, list) and self.addr in members:
                log.info("raft: added to the group through %s", m.id)
                return [str(a) for a in members]
        return None

    async def _join_group_of(self, best: Member | None) -> None:
        members: list[str] = []
        wiped = False
        if best is not None:
            got = await self.client.call(best.id, {"op": "raft_members"}, max_data=0,
                                         timeout=10.0)
            found = None if got is None else got[0].get("members")
            if isinstance(found, list):
                members = [str(a) for a in found if a != self.addr]
                wiped = self.addr in found
                if wiped:
                    log.warning("raft: the group still counts our address %s as a voter but "
                                "our Raft log is gone (a wiped cache dir); rejoining without "
                                "a vote until caught up with the leader", self.addr)
        self._start_raft(members, joining=bool(members), wiped=wiped and bool(members))
        if best is not None and members:
            await self._ask_to_add(best)

    async def _enter_group(self) -> None:
        saved = self.dir / "partners.json"
        if saved.exists():  # restarted with our cache dir: replay our log
            self._start_raft(json.loads(saved.read_text()))
            return
        await self._join_group_of(self._best_group())

    async def _supervise(self) -> None:
        """Stay in the cluster's one group (see the module docstring), remove members that
        left, and commit our membership record once per incarnation. Nothing waits for
        this; it retries."""
        me = self.membership.me
        assert self.raft is not None
        recorded = False
        while True:
            try:
                me.raft_n = len(self.raft.members())
                best = self._best_group()
                yield_to_best = best is not None and (
                    best.raft_n > 1 or (best.raft_n == 1 and best.id < me.id))
                if (me.raft_n == 1 and yield_to_best and best is not None
                        and (self.raft.status().get("log_entries") or 0) <= LONE_GROUP_ENTRIES):
                    log.info("raft: leaving our group of one to join %s's", best.id)
                    self.raft.destroy()
                    shutil.rmtree(self.dir, ignore_errors=True)
                    await self._join_group_of(best)
                    recorded = False
                await self._remove_departed()
                if not recorded:
                    await self.raft.submit({"op": "member", "node": me.id, "addr": me.addr,
                                            "cap": me.capacity,
                                            "tx": f"member/{me.id}/{me.incarnation}"},
                                           timeout=10)
                    recorded = True
            except NoQuorum as e:
                log.info("raft: %s", e)
            await trio.sleep(3 if recorded else 1)

    async def _remove_departed(self) -> None:
        """As leader, take members that left the cluster cleanly out of the group. Crashed
        members stay: they may come back with their log."""
        assert self.raft is not None
        if self.raft.status().get("role") != "leader":
            return
        departed = {m.raft for m in self.membership.members.values()
                    if m.state == LEFT and m.raft}
        for addr in sorted(departed & set(self.raft.members())):
            log.info("raft: removing %s, which left the cluster", addr)
            await self.raft.remove_member(addr, timeout=10)

    async def leave(self) -> None:
        """Leave the group. Returns once the group no longer counts us (bounded), so that
        the next node to leave still finds a quorum."""
        if self.raft is None:
            return
        others = [m.addr for m in self.membership.members.values()
                  if m.state == ALIVE and m.id != self.membership.me.id]
        me = self.membership.me
        with trio.move_on_after(12):
            try:
                await self.raft.submit({"op": "member", "node": me.id, "remove": True,
                                        "tx": f"leave/{me.id}/{me.incarnation}"}, timeout=4)
                if self.raft.status().get("role") == "leader":
                    # pysyncobj refuses a leader's removal of itself, and waiting for a
                    # successor fails in a group of two (one member cannot elect itself):
                    # hand leadership over, then be removed as a follower.
                    await self.raft.step_down()
                if self.raft.status().get("role") != "leader":
                    for m in list(self.membership.members.values()):
                        if m.state == ALIVE and await self.client.call(
                                m.id, {"op": "raft_remove", "raft": self.addr},
                                max_data=0, timeout=4.0) is not None:
                            break
            except NoQuorum as e:
                log.warning("could not leave the Raft group cleanly: %s", e)
        # Confirm the group no longer counts us (if the removal could not commit above, a
        # successor removes us after we stop), or the next node to leave would take the
        # group below a quorum of the rest.
        self.close()
        if others:
            await self._wait_removed(others)

    def close(self) -> None:
        """Stop our Raft member (its thread and sockets), without leaving the group."""
        if self.raft is not None and not self._closed:
            self._closed = True
            self.raft.destroy()

    async def _wait_removed(self, addrs: list[str], timeout: float = 20.0) -> None:
        with trio.move_on_after(timeout):
            while True:
                for addr in addrs:
                    try:
                        reply, _ = await self.pool.request(addr, {"op": "raft_members"},
                                                           timeout=2.0)
                    except PeerError:
                        continue
                    members = reply.get("members")
                    if isinstance(members, list) and members and self.addr not in members:
                        log.info("raft: the group removed us")
                        return
                await trio.sleep(0.3)
        log.warning("raft: the group still counted us %.0fs after we left", timeout)

    # -- serving peers and status ---------------------------------------------------------

    async def _members(self, peer: str, msg: dict[str, Any]) -> Reply:
        return {"members": self.raft.members() if self.raft else []}, None

    async def _change(self, peer: str, msg: dict[str, Any]) -> Reply:
        addr = field_str(msg, "raft")
        try:
            split_addr(addr)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if self.raft is None:
            raise PeerError("raft is not running here yet")
        if msg.get("op") == "raft_add":
            await self.raft.add_member(addr, timeout=25)
        else:
            await self.raft.remove_member(addr, timeout=25)
        return {"members": self.raft.members()}, None

    def status(self) -> dict[str, Any] | None:
        if self.raft is None:
            return None
        st = self.raft.status()
        st["members"] = self.raft.members()
        st["self"] = self.addr
        return st
