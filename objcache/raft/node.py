"""A Raft member (pysyncobj) replicating a deterministic state machine, with a trio-facing
`submit`.

The raft layer knows no objcache state: a member replicates whatever `StateMachine` it is
given (objcache.txn.state.ClusterState in a daemon, a counter machine in the stress test).
pysyncobj runs its own thread (autoTick); a submitted command's result comes back through
a callback on that thread and is handed to the trio task waiting for it with the trio
token (run_sync_soon is thread-safe). A command that cannot commit within its timeout (no
quorum, no leader) raises NoQuorum: callers turn that into EIO after a bounded wait.

The configuration is chosen from what was measured on these machines (see
docs/architecture.md, "Raft"):
- password: pysyncobj pickles commands on the wire, so every message is encrypted and
  authenticated with the cluster secret (needs the `cryptography` package);
- commands are msgpack bytes, so what is pickled is only bytes;
- useFork=False: forking a multi-threaded daemon for log compaction is unsafe;
- appendEntriesUseBatch=False: the batch period would add ~100 ms to every commit;
- a journal file and a full dump file in the node's own directory, so a restarted node
  replays its log;
- log compaction only after many entries and minutes, which keeps the compaction path
  (where a follower journal was seen to break under load) out of the hot path.
The follower's log handling is corrected in objcache/raft/follower_fix.py, and the port is
defended (own address only, authentication deadline, frame limits) in
objcache/raft/guard.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgpack
import trio
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

from objcache.errors import NoQuorum
from objcache.raft.follower_fix import FollowerFix
from objcache.raft.guard import GuardedTransport

log = logging.getLogger(__name__)

ROLES = {0: "follower", 1: "candidate", 2: "leader"}


class StateMachine(Protocol):
    """What a member replicates: `apply` must be deterministic (same commands, same
    results and state everywhere) and the object picklable (snapshots)."""

    def apply(self, cmd: dict[str, Any]) -> Any: ...


# Called on pysyncobj's thread after each applied command: (the machine, the command).
Applied = Callable[[Any, dict[str, Any]], None]


def make_conf(data_dir: Path, secret: str, bind: str | None = None) -> SyncObjConf:
    return SyncObjConf(
        bindAddress=bind,  # our own address: pysyncobj would bind 0.0.0.0
        password=secret,
        useFork=False,
        appendEntriesUseBatch=False,
        journalFile=str(data_dir / "raft.journal"),
        fullDumpFile=str(data_dir / "raft.dump"),
        dynamicMembershipChange=True,
        # Without a leader a command fails at once (MISSING_LEADER) and `_call` tries it
        # again until its timeout. pysyncobj's own wait keeps the command in its queue
        # with no deadline: a close that had answered EIO was sent when the network
        # healed, and took effect (the partition nemesis).
        commandsWaitLeader=False,
        autoTick=True,
        raftMinTimeout=0.4,
        raftMaxTimeout=1.4,
        connectionTimeout=3.5,
        # A leader that has heard from no majority for this long steps down (pysyncobj's
        # default is 30 s): a leader cut off from the majority stops taking commands
        # (which could only be settled after the heal, as in doubt) within seconds.
        leaderFallbackTimeout=3.5,
        logCompactionMinEntries=200_000,
        logCompactionMinTime=600,
        # one command up to this size travels as one message; bigger ones would take
        # pysyncobj's chunked path, which the follower fix does not cover
        appendEntriesBatchSizeBytes=16 << 20,
    )


def _ignore(machine: Any, cmd: dict[str, Any]) -> None:
    pass


class _Replica(FollowerFix, SyncObj):  # type: ignore[misc]
    def __init__(self, self_addr: str, partners: list[str], conf: SyncObjConf,
                 state: StateMachine, on_applied: Applied = _ignore,
                 joining: bool = False, wiped: bool = False) -> None:
        self.state = state
        self.on_applied = on_applied  # set before __init__: never dumped
        self.joining = joining  # see FollowerFix: no vote until caught up
        self.wiped = wiped  # see FollowerFix: nor an acknowledgement
        super().__init__(self_addr, partners, conf=conf, transportClass=GuardedTransport)
        # pysyncobj dumps (log compaction, a snapshot sent to a new follower) only hold
        # attributes set after its __init__: the state must be one of them.
        self._SyncObj__properies.discard("state")

    @replicated  # type: ignore[misc]
    def _apply(self, blob: bytes) -> Any:
        try:
            cmd = msgpack.unpackb(blob, raw=False)
        except Exception as e:  # the same bytes fail the same way everywhere
            return {"error": f"undecodable command: {e}"}
        if not isinstance(cmd, dict):
            return {"error": "a command must be a map"}
        result = self.state.apply(cmd)
        try:
            self.on_applied(self.state, cmd)
        except Exception:  # our caches are not the replicated state: never stop Raft
            log.exception("handing an applied command to this node's caches failed")
        return result


class RaftNode:
    def __init__(self, self_addr: str, partners: list[str], data_dir: Path,
                 secret: str, state: StateMachine, on_applied: Applied = _ignore,
                 joining: bool = False, wiped: bool = False) -> None:
        """`joining`: we start with no log into a group that has one; we neither vote
        nor stand for election until caught up (objcache/raft/follower_fix.py). `wiped`:
        the group counts our address as a voter already (our cache dir was lost); until
        caught up we do not count toward a commit either."""
        data_dir.mkdir(parents=True, exist_ok=True)
        self.addr = self_addr
        self._replica = _Replica(self_addr, [p for p in partners if p != self_addr],
                                 make_conf(data_dir, secret, self_addr), state, on_applied,
                                 joining, wiped)

    @property
    def state(self) -> Any:
        return self._replica.state  # a loaded dump replaces the object: never keep it

    async def _call(self, what: str, start: Any, timeout: float) -> Any:
        """Run a pysyncobj call that reports through callback(result, error) and wait for
        it from trio; NoQuorum if it fails or does not answer within `timeout`. While
        there is no leader (or ours is not connected) it is tried again every 50 ms.
        NoQuorum.maybe_sent says whether an attempt may have reached a leader's log."""
        token = trio.lowlevel.current_trio_token()
        deadline = trio.current_time() + timeout + 2
        sent = False
        while True:
            if not self._leader_reachable():
                error: Any = FAIL_REASON.MISSING_LEADER
            else:
                sent = True
                done = trio.Event()
                box: dict[str, Any] = {}

                def callback(result: Any, error: Any, box: dict[str, Any] = box,
                             done: trio.Event = done) -> None:  # on pysyncobj's thread
                    box["result"], box["error"] = result, error
                    token.run_sync_soon(done.set)

                start(callback)
                with trio.move_on_at(deadline):
                    await done.wait()
                if not done.is_set():
                    e = NoQuorum(f"raft {what} got no answer in {timeout:.0f}s")
                    e.maybe_sent = True
                    raise e
                error = box["error"]
                if error in (FAIL_REASON.SUCCESS, None):
                    return box["result"]
                if error not in _NOT_SENT:
                    e = NoQuorum(f"raft {what} failed: {_reason(error)}")
                    e.maybe_sent = True
                    raise e
            if error != FAIL_REASON.MISSING_LEADER or trio.current_time() + 0.05 > deadline:
                e = NoQuorum(f"raft {what} failed: {_reason(error)}")
                e.maybe_sent = sent and error not in _NOT_SENT
                raise e
            await trio.sleep(0.05)

    def _leader_reachable(self) -> bool:
        """Whether our member has a leader it can send to: itself, or a partner it is
        connected to. pysyncobj keeps the last leader of a follower that is connected to
        nobody (it never becomes a candidate), and would hand commands to a connection
        that is gone."""
        st = self._replica.getStatus()
        leader = st.get("leader")
        if leader is None:
            return False
        if str(leader) == self.addr:
            return True
        return st.get(f"{_PARTNER}{leader}") == _CONNECTED

    async def submit(self, cmd: dict[str, Any], timeout: float = 10.0) -> Any:
        """Commit `cmd` through the log and return what applying it returned."""
        blob = msgpack.packb(cmd, use_bin_type=True)
        return await self._call(f"command {cmd.get('op')!r}", lambda cb: self._replica._apply(
            blob, callback=cb, timeout=timeout), timeout)

    def members(self) -> list[str]:
        """The Raft group as this node's log has it (itself included)."""
        st = self._replica.getStatus()
        prefix = "partner_node_status_server_"
        return sorted([self.addr] + [k[len(prefix):] for k in st if k.startswith(prefix)])

    async def add_member(self, addr: str, timeout: float = 10.0) -> None:
        """Add a node to the group (one change at a time, through the log)."""
        if addr in self.members():
            return
        await self._call(f"add of {addr}",
                         lambda cb: self._replica.addNodeToCluster(addr, callback=cb), timeout)

    async def remove_member(self, addr: str, timeout: float = 10.0) -> None:
        if addr not in self.members():
            return
        await self._call(f"removal of {addr}",
                         lambda cb: self._replica.removeNodeFromCluster(addr, callback=cb),
                         timeout)

    async def step_down(self, timeout: float = 5.0) -> bool:
        """Hand leadership to the most caught-up follower (Raft TimeoutNow); whether we
        are no longer the leader within `timeout`. pysyncobj refuses a leader's removal
        of itself, so a leaving leader steps down first."""
        try:
            await self._call("leadership transfer",
                             lambda cb: self._replica.transferLeadership(callback=cb), 2.0)
        except NoQuorum:
            return False
        with trio.move_on_after(timeout):
            while self.status()["role"] == "leader":
                await trio.sleep(0.05)
            return True
        return False

    def status(self) -> dict[str, Any]:
        st = self._replica.getStatus()
        leader = st.get("leader")
        return {"role": ROLES.get(st.get("state"), str(st.get("state"))),
                "term": st.get("raft_term"), "commit_index": st.get("commit_idx"),
                "last_applied": st.get("last_applied"),
                "apply_lag": max(0, (st.get("commit_idx") or 0) - (st.get("last_applied") or 0)),
                "leader": None if leader is None else str(leader),
                "partners": st.get("partner_nodes_count"),
                "connected": sorted(k[len(_PARTNER):] for k, v in st.items()
                                    if k.startswith(_PARTNER) and v == _CONNECTED),
                "log_entries": st.get("log_len"),
                "voting": not self._replica.joining}

    def destroy(self) -> None:
        self._replica.destroy()


# Answers after which the command is in no log: pysyncobj did not hand it to a leader
# (none, or its queue was full), the leader refused it, the node asked was no longer the
# leader, or the entry it got was replaced by another term's (DISCARDED).
_NOT_SENT = {FAIL_REASON.MISSING_LEADER, FAIL_REASON.QUEUE_FULL, FAIL_REASON.REQUEST_DENIED,
             FAIL_REASON.NOT_LEADER, FAIL_REASON.DISCARDED}
_CONNECTED = 2  # pysyncobj's CONNECTION_STATE.CONNECTED in getStatus()
_PARTNER = "partner_node_status_server_"


def _reason(code: int) -> str:
    for name in dir(FAIL_REASON):
        if not name.startswith("_") and getattr(FAIL_REASON, name) == code:
            return name.lower().replace("_", " ")
    return str(code)

