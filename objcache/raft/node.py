"""A Raft member (pysyncobj) replicating `ClusterState`, with a trio-facing `submit`.

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
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgpack
import trio
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

from objcache.errors import ObjcacheError
from objcache.raft.state import ClusterState

log = logging.getLogger(__name__)

ROLES = {0: "follower", 1: "candidate", 2: "leader"}


class NoQuorum(ObjcacheError):
    """A command could not be committed in time (no leader, or no majority reachable)."""


def make_conf(data_dir: Path, secret: str) -> SyncObjConf:
    return SyncObjConf(
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
        # pysyncobj's chunked path, which _Replica._follow does not cover
        appendEntriesBatchSizeBytes=16 << 20,
    )


class _Replica(SyncObj):  # type: ignore[misc]
    def __init__(self, self_addr: str, partners: list[str], conf: SyncObjConf) -> None:
        self.state = ClusterState()
        self.on_changes: Any = None  # (changes, command) -> None; set before __init__: not dumped
        self._ack_limit: int | None = None  # see _follow
        super().__init__(self_addr, partners, conf=conf)
        # pysyncobj dumps (log compaction, a snapshot sent to a new follower) only hold
        # attributes set after its __init__: the state must be one of them.
        self._SyncObj__properies.discard("state")

    # pysyncobj 0.3.17's follower departs from Raft (section 5.3) in two ways that the
    # stress test (leader kill -9 under load) hits:
    # 1. It deletes every entry after prevLogIdx whenever it holds more than an
    #    append_entries message covers, even entries it already applied ("truncating
    #    already-applied log entries"). With pipelined appends and resends after a leader
    #    change that is most messages. Raft deletes only entries that conflict.
    # 2. Rejecting a message whose prevLogIdx is beyond its log, it asks for "my last index
    #    + 1" even when that tail is another term's and conflicts; rejecting a mismatch it
    #    asks for prevLogIdx. The leader pipelines several messages per tick, so the two
    #    answers alternate forever and a restarted old leader never catches up (seen as
    #    clients stalled for minutes).
    # So each message first loses the leading entries we already hold (same index and
    # term); if nothing new is left, our log is left alone, and we acknowledge only what is
    # verified (the message's end, or our whole log when its tail is the sender's own term:
    # a leader never rewrites its own term), with the commit index capped to that point so
    # an unverified tail is never applied. A rejection asks for our commit index + 1 when our
    # tail is not the leader's term: committed entries never conflict, and resent entries
    # are trimmed. Snapshot and chunked ("transmission") messages go to pysyncobj unchanged;
    # appendEntriesBatchSizeBytes keeps commands out of the chunked path.
    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> Any:
        self._ack_limit = None
        if (isinstance(message, dict) and message.get("type") == "append_entries"
                and "prevLogIdx" in message and message.get("transmission") is None):
            message = self._follow(message)
        try:
            return SyncObj._SyncObj__onMessageReceived(self, node, message)
        finally:
            self._ack_limit = None

    def _follow(self, message: dict[str, Any]) -> dict[str, Any]:
        get = self._SyncObj__getEntries
        prev = get(message["prevLogIdx"], 1)
        if not prev or prev[0][2] != message["prevLogTerm"]:
            return message  # rejected by pysyncobj; the answer is fixed in __sendNextNodeIdx
        entries = message.get("entries") or []
        known = 0
        for _, idx, term in entries:
            mine = get(idx, 1)
            if not mine or mine[0][2] != term:
                break
            known += 1
        if known < len(entries):
            if known == 0:
                return message
            _, last_idx, last_term = entries[known - 1]
            return dict(message, entries=entries[known:], prevLogIdx=last_idx,
                        prevLogTerm=last_term)
        verified = entries[-1][1] if entries else message["prevLogIdx"]
        _, my_last, my_term = self._SyncObj__raftLog[-1]
        if my_last == verified or my_term == message["term"]:
            return dict(message, entries=[], prevLogIdx=my_last, prevLogTerm=my_term)
        # Our tail is another term's: keep it (it may be committed), but neither
        # acknowledge nor commit past what this message verified.
        self._ack_limit = verified + 1
        return dict(message, entries=[], prevLogIdx=my_last, prevLogTerm=my_term,
                    commit_index=min(message["commit_index"], verified))

    def _SyncObj__sendNextNodeIdx(self, node: Any, reset: bool = False,
                                  nextNodeIdx: int | None = None,
                                  success: bool = False) -> Any:
        if success and self._ack_limit is not None:
            nextNodeIdx = self._ack_limit
        elif reset and not success:
            _, my_last, my_term = self._SyncObj__raftLog[-1]
            if my_term != self._SyncObj__raftCurrentTerm:
                asked = my_last + 1 if nextNodeIdx is None else nextNodeIdx
                nextNodeIdx = min(asked, self._SyncObj__raftCommitIndex + 1)
        return SyncObj._SyncObj__sendNextNodeIdx(self, node, reset=reset,
                                                 nextNodeIdx=nextNodeIdx, success=success)

    @replicated  # type: ignore[misc]
    def _apply(self, blob: bytes) -> Any:
        try:
            cmd = msgpack.unpackb(blob, raw=False)
        except Exception as e:  # the same bytes fail the same way everywhere
            return {"error": f"undecodable command: {e}"}
        if not isinstance(cmd, dict):
            return {"error": "a command must be a map"}
        result = self.state.apply(cmd)
        changes = self.state.last_changes
        if changes and self.on_changes is not None:
            try:
                self.on_changes(changes, cmd)
            except Exception:  # our caches are not the replicated state: never stop Raft
                log.exception("applying namespace changes to this node's caches failed")
        return result


class RaftNode:
    def __init__(self, self_addr: str, partners: list[str], data_dir: Path,
                 secret: str) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.addr = self_addr
        self._replica = _Replica(self_addr, [p for p in partners if p != self_addr],
                                 make_conf(data_dir, secret))

    @property
    def state(self) -> ClusterState:
        return self._replica.state  # a loaded dump replaces the object: never keep it

    def set_listener(self, fn: Any) -> None:
        """`fn(changes, command)` runs on Raft's thread after each namespace command."""
        self._replica.on_changes = fn

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

