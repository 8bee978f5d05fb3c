"""The transaction client: how a node commits namespace changes and replicates closed files.

A filesystem call that changes the namespace builds one `ns.*` command (objcache.txn.
namespace) and commits it through the Raft log. The command carries a transaction id, so
resubmitting it after a lost reply or a leader change applies it once; submission is
retried until a deadline, then the call fails with EIO (NoQuorum) without anything
half-applied: a command is one log entry, applied whole or not at all.

Closed files are replicated before their commit: the other holders pull the sealed blob
from this node (`dpull`, then `dread` pieces), so when close() returns the content is on
`replicas` nodes and the entry naming them is committed.

Reads that must see every earlier close on any node (open, a lookup that found nothing)
first pass a barrier, shared by all callers that arrive while one is in flight: the
leader's commit index, confirmed by a majority of the voters (objcache.cluster.readindex),
applied here; or else a no-op through the log (a node whose log has applied the no-op has
applied everything before it).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

import trio

from objcache.cluster.peers import field_int, field_str
from objcache.entries import FileEntry
from objcache.errors import (
    InDoubt,
    NoQuorum,
    NotFound,
    ObjcacheError,
    PeerError,
    ProtocolError,
    StaleObject,
    error_from_code,
)
from objcache.rounds import SharedRounds
from objcache.txn.dirtystore import PIECE, DirtyStore
from objcache.txn.state import ClusterState

if TYPE_CHECKING:
    from objcache.cluster.node import ClusterNode
    from objcache.cluster.peers import Handler, Reply

log = logging.getLogger(__name__)

BARRIER_TIMEOUT = 3.0
# A read index takes milliseconds; one that has not come within this (the leader cut off,
# a new one not yet known) leaves the rest of BARRIER_TIMEOUT to the no-op, which tries
# again until a leader answers.
READ_INDEX_WAIT = 0.5
DEGRADED_FOR = 5.0  # after a failed barrier, serve from what we have applied this long
_EMPTY = ClusterState()
MAX_BLOB = 5 << 40
HOLDER_RETRY = 0.2  # seconds between rounds over a blob's holders while none can serve it
OWNERS_KEPT = 100_000  # keys whose write-back owner is remembered (then all forgotten)


def key_point(key: str) -> str:
    """The ring point of an inode (its owner): the key itself, directories without '/'."""
    return "inode\0" + key.rstrip("/")


class TxnClient:
    def __init__(self, node: ClusterNode, dirty: DirtyStore, replicas: int,
                 timeout: float) -> None:
        self.node = node
        self.node_id = node.node_id
        self.dirty = dirty
        self.replicas = max(1, replicas)
        self.timeout = timeout
        self._seq = itertools.count(1)
        self._incarnation = uuid.uuid4().hex[:8]
        self._barriers = SharedRounds[None]()
        self._degraded_until = 0.0
        # Changes that answered ETIMEDOUT, by transaction id, until a fence settles them;
        # then their outcome (the last 20), for `objcache status`.
        self.in_doubt: dict[str, str] = {}
        self.settled: list[str] = []
        self._doubt = trio.Event()
        self._owners: dict[str, str] = {}  # key -> owner on `_owners_of`'s ring
        self._owners_of: tuple[object, set[str]] = (None, set())

    def routes(self) -> dict[str, Handler]:
        """The dirty-blob requests this node answers (replication and reads of blobs)."""
        return {"dread": self._dread, "dpull": self._dpull, "dstage": self._dstage}

    def has_caught_up_once(self) -> bool:
        """Whether our Raft member caught up with the group's log since it started (the
        bounded wait before the mount succeeded)."""
        return self.node.raft.ready

    def caught_up(self) -> bool:
        """Our Raft member follows a leader and has applied all it knows is committed (so
        the entries we read are not a stale or empty view)."""
        group = self.node.raft
        if group.raft is None or not group.ready:
            return False
        st = group.raft.status()
        return st["leader"] is not None and st["apply_lag"] == 0

    @property
    def state(self) -> ClusterState:
        state = self.node.raft.state
        return state if state is not None else _EMPTY

    # -- committing -----------------------------------------------------------------------

    async def submit(self, cmd: dict[str, Any], background: bool = False
                     ) -> dict[str, Any]:
        """Commit one command; its result, or the domain error it reports. `background`:
        write-back's own bookkeeping, which no user here waits for (a learner that only
        does that keeps following the log lazily: objcache.cluster.learner).

        If it could not commit before --txn-timeout and may have reached a leader's log,
        its outcome is settled before the call answers: a `fence` entry either finds it
        applied (then this is its result) or makes the log refuse it for good (NoQuorum,
        EIO: it never takes effect). A node cut off from the majority cannot commit the
        fence either: after --txn-timeout more, InDoubt (ETIMEDOUT), and the fence is
        retried in the background (`settle_loop`) until the outcome is known."""
        tx = f"{self.node_id}/{self._incarnation}/{next(self._seq)}"
        cmd = dict(cmd, by=self.node_id, tx=tx)
        what = f"{cmd['op']} of {cmd.get('key') or cmd.get('src')!r}"
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        maybe_sent = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            raft = self.node.raft.raft
            if raft is None:
                last = NoQuorum("raft is not running yet")
                await trio.sleep(min(0.2, left))
                continue
            try:
                return self._result(what, await raft.submit(
                    cmd, timeout=max(0.5, min(left, 5.0)), background=background))
            except NoQuorum as e:
                last = e
                maybe_sent = maybe_sent or e.maybe_sent
                await trio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if not maybe_sent:
            raise NoQuorum(f"{what} could not commit within {self.timeout:.0f}s "
                           f"(no leader reachable: {last})")
        settled = await self._fence([tx], time.monotonic() + self.timeout)
        if settled is not None:
            if tx in settled:
                log.info("%s committed after its deadline (settled by a fence)", what)
                return self._result(what, settled[tx])
            raise NoQuorum(f"{what} could not commit within {self.timeout:.0f}s ({last}); "
                           "fenced: it never takes effect")
        self.in_doubt[tx] = what
        self._doubt.set()
        raise InDoubt(f"{what} could not commit within {self.timeout:.0f}s ({last}), and "
                      f"its outcome could not be settled within {self.timeout:.0f}s more "
                      "(cut off from the majority?): it may still take effect")

    @staticmethod
    def _result(what: str, result: Any) -> dict[str, Any]:
        if isinstance(result, dict) and "error" in result:
            code = result["error"]
            raise error_from_code(code, f"{what}: {code}")
        return result if isinstance(result, dict) else {}

    async def _fence(self, txs: list[str], deadline: float) -> dict[str, Any] | None:
        """Commit a fence of `txs` (objcache.txn.state: each is applied already, or is
        refused from now on) before `deadline`: the results of those that were applied,
        or None if the fence could not commit."""
        cmd = {"op": "fence", "txs": txs, "by": self.node_id,
               "tx": f"{self.node_id}/{self._incarnation}/{next(self._seq)}"}
        while True:
            left = deadline - time.monotonic()
            raft = self.node.raft.raft
            if left <= 0:
                return None
            try:
                if raft is None:
                    raise NoQuorum("raft is not running yet")
                got = await raft.submit(cmd, timeout=max(0.5, min(left, 5.0)))
            except NoQuorum:
                await trio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            if isinstance(got, dict) and isinstance(got.get("applied"), dict):
                return got["applied"]
            return None  # (a malformed fence: cannot happen with our own ids)

    async def settle_loop(self) -> None:
        """Settle the changes that answered ETIMEDOUT (in doubt) as soon as this node
        reaches the majority again: their fence commits, and each outcome is logged and
        kept for `objcache status`."""
        while True:
            if not self.in_doubt:
                await self._doubt.wait()
                self._doubt = trio.Event()
                continue
            txs = list(self.in_doubt)
            applied = await self._fence(txs, time.monotonic() + 5.0)
            if applied is None:
                await trio.sleep(1.0)
                continue
            for tx in txs:
                what = self.in_doubt.pop(tx)
                outcome = "took effect" if tx in applied else "did not take effect (fenced)"
                log.warning("%s, which answered ETIMEDOUT (in doubt), %s", what, outcome)
                self.settled.append(f"{what}: {outcome}")
            del self.settled[:-20]

    async def barrier(self) -> None:
        """Wait until this node has applied everything committed before the call."""
        if time.monotonic() < self._degraded_until:
            return
        try:
            await self._barriers.join(lambda: self._noop(time.monotonic() + BARRIER_TIMEOUT))
        except NoQuorum as e:
            log.warning("no quorum for a read barrier (%s); serving from what this node "
                        "has applied for %.0fs", e, DEGRADED_FOR)
            self._degraded_until = time.monotonic() + DEGRADED_FOR

    async def _noop(self, deadline: float) -> None:
        """A read index from the leader (objcache.cluster.readindex: no log entry), or
        else a no-op through the log, tried again until `deadline`: a leader change answers
        at once (LEADER_CHANGED), and the new leader is usually there well before the
        deadline; giving up at the first answer left a node of the majority serving a
        stale view for DEGRADED_FOR after a leader change elsewhere (the partition
        nemesis's close-to-open violations on connected nodes)."""
        if await self.node.raft.reads.barrier(min(READ_INDEX_WAIT,
                                                  deadline - time.monotonic())):
            return
        while True:
            left = deadline - time.monotonic()
            raft = self.node.raft.raft
            try:
                if raft is None:
                    raise NoQuorum("raft is not running yet")
                await raft.submit({"op": "ns.noop"}, timeout=max(0.2, left))
                return
            except NoQuorum:
                if time.monotonic() + 0.05 >= deadline:
                    raise
            await trio.sleep(0.05)

    # -- placement ------------------------------------------------------------------------

    def owner(self, key: str) -> str:
        """The node that writes `key` back. Remembered until the ring (a new object at
        every membership change) or the suspects change: the write-back loop asks for
        every dirty key twice a second on every node (200 dirty keys cost 1.7 ms a scan
        at 32 members, 0.11 cores for the cluster)."""
        ms = self.node.membership
        ring, suspects = self._owners_of
        if ms.ring is not ring or ms.suspects != suspects or len(self._owners) > OWNERS_KEPT:
            self._owners.clear()
            self._owners_of = (ms.ring, set(ms.suspects))
        got = self._owners.get(key)
        if got is None:
            got = self._owners[key] = ms.owner(key_point(key))
        return got

    def _candidates(self, key: str) -> list[str]:
        """Nodes to hold a replica, best first: the owner, then the ring's successors, then
        members the Raft log records that our membership has not reached yet."""
        ms = self.node.membership
        point = key_point(key)
        skip = set(ms.suspects) | {self.node_id}
        out: list[str] = []
        while True:
            n = ms.ring.owner(point, skip)
            if n is None:
                break
            out.append(n)
            skip.add(n)
        recorded = self._recorded()
        self._introduce(recorded)
        return out + [n for n in recorded if n not in skip and ms.joining(n)]

    def _recorded(self) -> list[str]:
        return self.state.member_ids()

    def _introduce(self, nodes: list[str]) -> None:
        """Tell our membership the addresses the Raft log records for those of `nodes` it
        has not heard of. A node restarted while no seed of it was up knows only itself
        until the others retry their seeds: its ring was itself alone, so its closes were
        acknowledged with its own copy only, and it could not read the blobs others held
        (chaos seed 3120)."""
        ms = self.node.membership
        st = self.state
        for n in nodes:
            if n != self.node_id and ms.addr_of(n) is None:
                with st.lock:
                    rec = st.members.get(n)
                if rec is not None:
                    ms.hear_of(n, str(rec["addr"]), int(rec["cap"]))

    def new_cid(self) -> str:
        return f"{uuid.uuid4().hex}"

    def stage_targets(self, key: str) -> list[str]:
        """The nodes that will most likely hold `key`'s replicas: stage to them."""
        return self._candidates(key)[:self.replicas - 1]

    async def stage(self, node: str, sid: str, end: int) -> bool:
        """Have `node` pull our exposed working copy `sid` up to `end` bytes."""
        got = await self.node.client.call(node, {"op": "dstage", "sid": sid, "end": end,
                                                 "from": self.node_id},
                                          max_data=0, timeout=self.timeout + 60)
        return got is not None and bool(got[0].get("ok"))

    async def replicate(self, key: str, cid: str, size: int,
                        staged: dict[str, tuple[str, int]] | None = None) -> list[str]:
        """Have `replicas - 1` other nodes pull blob `cid` from us; the holders, us first.
        `staged`: node -> (stage id, bytes) it already pulled while the file was written.
        With fewer live nodes than that, the copies that could be made."""
        holders = [self.node_id]
        staged = staged or {}
        for node in list(staged) + [n for n in self._candidates(key) if n not in staged]:
            if len(holders) >= self.replicas:
                break
            msg: dict[str, Any] = {"op": "dpull", "cid": cid, "size": size,
                                   "from": self.node_id}
            if node in staged:
                msg["stage"], msg["staged"] = staged[node]
            got = await self.node.client.call(node, msg, max_data=0,
                                              timeout=self.timeout + 60)
            if got is not None and got[0].get("ok"):
                holders.append(node)
        # (members the ring lacks but the log records count: one may have been unreachable)
        known = set(self.node.membership.ring.members) | set(self._recorded())
        if len(holders) < min(self.replicas, len(known)):
            log.warning("%r closed with %d copies (wanted %d): not enough live nodes",
                        key, len(holders), self.replicas)
        return holders

    async def restore_copies(self) -> None:
        """Pull again every blob the log names this node a holder of and our dirty store
        lacks: the cache dir was lost (a node replaced, an emptyDir volume). Until then
        those files have one copy fewer than their close made, and a rolling restart
        that replaced their other holder next lost them for good (ESTALE: "no longer
        held"). Waits (unbounded; the caller bounds its own wait) until caught up, so
        that the entries are the group's."""
        while not self.caught_up():
            await trio.sleep(0.2)
        st = self.state
        with st.lock:
            lost = {e.cid: e for e in st.ns.entries.values()
                    if isinstance(e, FileEntry) and e.cid and self.node_id in e.holders
                    and not self.dirty.has(e.cid)}
        if not lost:
            return
        log.warning("%d closed files name this node a holder and their bytes are not in "
                    "its cache dir (lost with it): pulling them again", len(lost))
        limit = trio.CapacityLimiter(4)
        failed: list[str] = []

        async def one(e: FileEntry) -> None:
            assert e.cid is not None
            async with limit:
                try:
                    await self.pull(e.cid, e.size, list(e.holders))
                except (ObjcacheError, OSError) as ex:  # (no holder left, disk full)
                    failed.append(e.cid)
                    log.error("could not pull blob %s again: %s", e.cid, ex)

        async with trio.open_nursery() as nursery:
            for e in lost.values():
                nursery.start_soon(one, e)
        log.info("pulled %d blobs this node holds again (%d failed)",
                 len(lost) - len(failed), len(failed))

    async def read_blob(self, cid: str, holders: list[str], offset: int, length: int
                        ) -> bytes:
        if length <= 0:
            return b""
        if self.dirty.has(cid):
            data = await self.dirty.read(cid, offset, length)
            if len(data) != length:
                raise NotFound(f"blob {cid} has {offset + len(data)} bytes here")
            return data
        got = await self._from_a_holder(cid, holders, {"off": offset, "len": length},
                                        length)
        return bytes(got)

    async def read_blob_into(self, cid: str, holders: list[str], offset: int,
                             buf: memoryview) -> None:
        """Fill `buf` with blob `cid`'s bytes from `offset`, received in place from a
        holder (a holder sending another length is a protocol error: the next one is
        asked)."""
        if self.dirty.has(cid):
            data = await self.dirty.read(cid, offset, len(buf))
            if len(data) != len(buf):
                raise NotFound(f"blob {cid} has {offset + len(data)} bytes here")
            buf[:] = data
            return
        await self._from_a_holder(cid, holders, {"off": offset, "len": len(buf)}, len(buf),
                                  into=buf)

    async def _from_a_holder(self, cid: str, holders: list[str], ask: dict[str, Any],
                             length: int, into: memoryview | None = None
                             ) -> bytes | memoryview:
        """A `dread` answered by the first holder that can. None can yet (a restarted
        node has not heard of the others, a holder is being routed around): asked again
        until --peer-timeout has passed since the first try, then PeerError. Holders
        routed around are asked last, and a request to one of them ends at that deadline
        too: its connect alone may take 2 s (seed 4803: two holders cut off from an
        isolated node made a READ take 4.0 s and the next 6.8 s with a 3 s
        --peer-timeout, and the read overran its bound). A holder that answers gets the
        whole request timeout: a piece may be slow to come on a busy node."""
        ms = self.node.membership
        deadline = time.monotonic() + ms.timeout
        gone: set[str] = set()  # holders that answered they do not hold it (any more)
        while True:
            self._introduce(holders)
            # (sorted is stable: the log's order among the reachable ones)
            for node in sorted(holders, key=lambda n: n in ms.suspects):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if node == self.node_id or node in gone or ms.addr_of(node) is None:
                    continue
                got = None
                bound = left if node in ms.suspects else math.inf
                with trio.move_on_after(bound):
                    try:
                        got = await self.node.client.call(
                            node, {"op": "dread", "cid": cid, **ask}, max_data=length,
                            into=into, timeout=min(self.node.request_timeout, bound))
                    except NotFound:
                        gone.add(node)
                        continue
                if got is not None and got[1] is not None:
                    if len(got[1]) == length:
                        return got[1]
                    # (the caller asks for bytes the blob has: a short answer would reach
                    # the application as an early end of file)
                    log.warning("holder %s sent %d bytes of blob %s, not %d: asking another",
                                node, len(got[1]), cid, length)
            if gone and gone >= set(holders) - {self.node_id}:
                # Every holder dropped it: a newer version replaced this one, and our view
                # is older (a node cut off from the majority serves what it applied).
                # ESTALE, as for a handle whose version is gone: reopen to see the file.
                raise StaleObject(f"blob {cid} is no longer held by {', '.join(holders)}")
            if time.monotonic() >= deadline:
                raise PeerError(f"no holder of blob {cid} ({', '.join(holders)}) could "
                                f"serve it within {ms.timeout:g}s")
            await trio.sleep(min(HOLDER_RETRY, max(0.0, deadline - time.monotonic())))

    async def pull(self, cid: str, size: int, holders: list[str], stage: str | None = None,
                   staged: int = 0) -> None:
        """Get a local copy of blob `cid` from any of `holders` (starting from what stage
        `stage` holds, if given)."""
        live = [h for h in holders if h != self.node_id]

        async def reader(off: int, buf: memoryview) -> None:
            await self.read_blob_into(cid, live, off, buf)

        await self.dirty.pull(cid, size, reader, stage, staged)

    # -- serving peers --------------------------------------------------------------------

    @staticmethod
    def _cid(msg: dict[str, Any]) -> str:
        cid = msg.get("cid")
        if not isinstance(cid, str) or not cid or len(cid) > 128 or "/" in cid:
            raise ProtocolError("request field 'cid' is not a content id")
        return cid

    async def _dread(self, peer: str, msg: dict[str, Any]) -> Reply:
        cid = self._cid(msg)
        off = field_int(msg, "off", 0, MAX_BLOB)
        n = field_int(msg, "len", 0, max(PIECE, self.node.placement.chunk_size))
        data = await self.dirty.read(cid, off, n)
        return {"data": len(data)}, data

    async def _dpull(self, peer: str, msg: dict[str, Any]) -> Reply:
        cid = self._cid(msg)
        size = field_int(msg, "size", 0, MAX_BLOB)
        stage = self._cid({"cid": msg["stage"]}) if "stage" in msg else None
        staged = field_int(msg, "staged", 0, MAX_BLOB) if stage else 0
        await self.pull(cid, size, [field_str(msg, "from")], stage, staged)
        return {"ok": True}, None

    async def _dstage(self, peer: str, msg: dict[str, Any]) -> Reply:
        sid = self._cid({"cid": msg.get("sid")})
        end = field_int(msg, "end", 0, MAX_BLOB)
        writer = field_str(msg, "from")

        async def reader(off: int, buf: memoryview) -> None:
            await self.read_blob_into(sid, [writer], off, buf)

        await self.dirty.stage(sid, end, reader)
        return {"ok": True}, None
