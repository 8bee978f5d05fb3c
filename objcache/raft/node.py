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
        commandsWaitLeader=True,
        autoTick=True,
        raftMinTimeout=0.4,
        raftMaxTimeout=1.4,
        connectionTimeout=3.5,
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
                 state: StateMachine, on_applied: Applied = _ignore) -> None:
        self.state = state
        self.on_applied = on_applied  # set before __init__: never dumped
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
                 secret: str, state: StateMachine, on_applied: Applied = _ignore) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.addr = self_addr
        self._replica = _Replica(self_addr, [p for p in partners if p != self_addr],
                                 make_conf(data_dir, secret, self_addr), state, on_applied)

    @property
    def state(self) -> Any:
        return self._replica.state  # a loaded dump replaces the object: never keep it

    async def _call(self, what: str, start: Any, timeout: float) -> Any:
        """Run a pysyncobj call that reports through callback(result, error) and wait for
        it from trio; NoQuorum if it fails or does not answer within `timeout`."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: dict[str, Any] = {}

        def callback(result: Any, error: Any) -> None:  # on pysyncobj's thread
            box["result"], box["error"] = result, error
            token.run_sync_soon(done.set)

        start(callback)
        with trio.move_on_after(timeout + 2):
            await done.wait()
        if not done.is_set():
            raise NoQuorum(f"raft {what} got no answer in {timeout:.0f}s")
        if box["error"] not in (FAIL_REASON.SUCCESS, None):
            raise NoQuorum(f"raft {what} failed: {_reason(box['error'])}")
        return box["result"]

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
                "log_entries": st.get("log_len")}

    def destroy(self) -> None:
        self._replica.destroy()


def _reason(code: int) -> str:
    for name in dir(FAIL_REASON):
        if not name.startswith("_") and getattr(FAIL_REASON, name) == code:
            return name.lower().replace("_", " ")
    return str(code)

