"""This daemon as a cluster member: the peer server, the connection pool, membership, and
the chunk placement the chunk cache asks (`ChunkPeers`).

Requests this node serves: membership (join, ping, leave) and chunks (read a range of a
chunk the caller says we own, copy a whole chunk, warm chunks ahead of a reader). Every
field of a request is checked; a request that does not parse is a protocol error and
drops the connection. A peer that fails to answer is routed around and the read falls
back to S3: a dead peer costs GETs, never a failed read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from objcache.cache.chunks import ChunkCache
from objcache.cluster.membership import ALIVE, LEFT, Member, Membership
from objcache.cluster.peers import PeerPool, PeerServer, split_addr
from objcache.cluster.ring import chunk_point
from objcache.config import MountConfig
from objcache.errors import PeerError, ProtocolError, UserError
from objcache.raft.node import NoQuorum, RaftNode

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
MAX_OBJECT_SIZE = 5 << 40  # S3's limit; anything larger in a request is garbage
MAX_PREFETCH_ITEMS = 4096
PREFETCH_TIMEOUT = 3600.0  # an owner fetching thousands of chunks; cancelled if it dies
WARM_AGAIN = 10.0  # seconds before the same chunk is worth warming at its owner again
LONE_GROUP_ENTRIES = 8  # a Raft group of one this short holds only its own start-up


def load_secret(path: str | None) -> bytes:
    if not path:
        raise UserError("--listen needs --cluster-secret-file (the shared cluster key)")
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise UserError(f"cluster secret file {path} is not readable: {e.strerror}") from None
    if len(key) < MIN_SECRET_BYTES:
        raise UserError(f"cluster secret file {path} holds {len(key)} bytes; use at least "
                        f"{MIN_SECRET_BYTES} random bytes (e.g. openssl rand -hex 32)")
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("cluster secret file %s is readable by other users", path)
    return key


def bind_listener(addr: str) -> socket.socket:
    """Bind the peer port before mounting, so a taken port is a clear start-up error."""
    try:
        host, port = split_addr(addr)
    except ValueError as e:
        raise UserError(f"invalid --listen: {e}") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        raise UserError(f"cannot listen on {addr}: {e.strerror or e}") from None
    return sock


def raft_address(cfg: MountConfig) -> str:
    """This node's Raft address: the --listen host, port --raft-port (default listen + 1)."""
    assert cfg.listen
    host, port = split_addr(cfg.listen)
    return f"{host}:{cfg.raft_port or port + 1}"


def _str(msg: dict[str, Any], name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str):
        raise ProtocolError(f"request field {name!r} is not a string")
    return v


def _int(msg: dict[str, Any], name: str, lo: int, hi: int) -> int:
    v = msg.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"request field {name!r} is not an integer in [{lo}, {hi}]")
    return v


class ClusterNode:
    def __init__(self, cfg: MountConfig, key: bytes, chunks: ChunkCache,
                 sock: socket.socket, raft_dir: Path) -> None:
        assert cfg.listen
        self.node_id = cfg.node_id or cfg.listen
        self.listen = cfg.listen
        self.raft_addr = raft_address(cfg)
        self.raft_dir = raft_dir
        self.raft_secret = key.hex()
        self.raft: RaftNode | None = None
        self.chunks = chunks
        self.chunk_size = chunks.chunk_size
        # Requests wait as long as an owner may need to fetch from S3; a peer that stops
        # answering heartbeats has its requests cancelled sooner (on_suspect below).
        self.request_timeout = cfg.s3_retry_seconds + 10
        self.pool = PeerPool(key, self.node_id)
        seeds = [p.strip() for p in (cfg.peers or "").split(",") if p.strip()]
        me = Member(self.node_id, cfg.listen, cfg.cache_size, time.time_ns(),
                    raft=self.raft_addr)
        self.membership = Membership(me, seeds, self.pool, cfg.peer_timeout,
                                     used=lambda: chunks.used)
        self.membership.on_suspect = self._cancel_requests_to
        self._sock = sock
        self.local_stats: Callable[[], dict[str, Any]] = lambda: {}  # set by the daemon
        self.server = PeerServer(key, self._handle)
        self._inflight: dict[str, set[trio.CancelScope]] = defaultdict(set)
        self._nursery: trio.Nursery | None = None
        self._warmed: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        self.txn: Any = None  # objcache.txn.coordinator.TxnClient, which sets itself here
        # Namespace changes applied by Raft (on its thread) go to this, on the trio thread.
        self.on_ns_changes: Callable[[list[Any], str | None], None] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        chunks.peers = self

    async def start(self, nursery: trio.Nursery) -> None:
        """Serve peers, then join the cluster (raises UserError if the secret is refused)."""
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        await nursery.start(trio.serve_listeners, self.server.serve_one, [listener])
        await self.membership.join()
        nursery.start_soon(self.membership.run)
        nursery.start_soon(self._raft_supervisor)
        if self.txn is not None:
            await self._catch_up()

    async def _catch_up(self, timeout: float = 60.0) -> None:
        """Wait until our Raft member has applied the cluster's log (a barrier passed), so
        that what we mount shows every committed change."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.raft is not None:
                try:
                    await self.raft.submit({"op": "ns.noop"}, timeout=5)
                    self.txn.ready = True
                    log.info("caught up with the cluster's log in %.2fs",
                             time.monotonic() - t0)
                    return
                except NoQuorum as e:
                    log.info("waiting for the cluster's log: %s", e)
            await trio.sleep(0.2)
        log.warning("could not catch up with the cluster's log in %.0fs; mounting anyway "
                    "(changes appear as they are applied)", timeout)

    def _ns_changed(self, changes: list[Any], cmd: dict[str, Any]) -> None:
        """On pysyncobj's thread: hand the changes to the trio thread."""
        token, listener = self._token, self.on_ns_changes
        if token is None or listener is None:
            return
        by = cmd.get("by")
        try:
            token.run_sync_soon(listener, changes, by if isinstance(by, str) else None)
        except trio.RunFinishedError:
            pass

    # -- Raft -----------------------------------------------------------------------------

    def _start_raft(self, partners: list[str]) -> None:
        """Start our Raft member. The partners it starts with are saved: pysyncobj's
        journal records membership changes relative to them, so a restart with the same
        cache dir must start from the same list."""
        saved = self.raft_dir / "partners.json"
        self.raft_dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(partners))
        self.raft = RaftNode(self.raft_addr, partners, self.raft_dir, self.raft_secret)
        self.raft.set_listener(self._ns_changed)
        log.info("raft member %s started with partners %s", self.raft_addr, partners or "none")

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
            got = await self._call(m.id, {"op": "raft_add", "raft": self.raft_addr},
                                   max_data=0, timeout=30.0)
            members = None if got is None else got[0].get("members")
            if isinstance(members, list) and self.raft_addr in members:
                log.info("raft: added to the group through %s", m.id)
                return [str(a) for a in members]
        return None

    async def _join_group_of(self, best: Member | None) -> None:
        """Start our member with `best`'s group as partners, then have us added to it
        (pysyncobj wants the new node running first: the change needs its vote)."""
        members: list[str] = []
        if best is not None:
            got = await self._call(best.id, {"op": "raft_members"}, max_data=0, timeout=10.0)
            found = None if got is None else got[0].get("members")
            if isinstance(found, list):
                members = [str(a) for a in found if a != self.raft_addr]
        self._start_raft(members)
        if best is not None and members:
            await self._ask_to_add(best)

    async def _enter_group(self) -> None:
        saved = self.raft_dir / "partners.json"
        if saved.exists():  # restarted with our cache dir: replay our log
            self._start_raft(json.loads(saved.read_text()))
            return
        await self._join_group_of(self._best_group())

    async def _raft_supervisor(self) -> None:
        """Get into the cluster's Raft group and stay there.

        A starting node asks a member to add it (any member forwards that to the leader)
        and then starts with that group's members as partners; with nobody to ask it forms
        a group of one. Nodes started at the same moment (a DaemonSet rollout) may each
        have formed a group of one: a lone node that still holds only its start-up entries
        and sees a larger group, or a lone node with a lower id, discards its group and
        joins that one, so the cluster converges on one group. Then our membership record
        is committed, once per incarnation. Nothing waits for this; it retries."""
        me = self.membership.me
        await self._enter_group()
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
                    shutil.rmtree(self.raft_dir, ignore_errors=True)
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
        """As leader, take members that left the cluster cleanly out of the Raft group (a
        leaving leader cannot remove itself; its successor does it here). Crashed members
        stay: they may come back with their log."""
        assert self.raft is not None
        if self.raft.status().get("role") != "leader":
            return
        departed = {m.raft for m in self.membership.members.values()
                    if m.state == LEFT and m.raft}
        for addr in sorted(departed & set(self.raft.members())):
            log.info("raft: removing %s, which left the cluster", addr)
            await self.raft.remove_member(addr, timeout=10)

    async def leave(self) -> None:
        """Leave the ring and the Raft group. Returns once the group no longer counts us
        (bounded), so that the next node to leave still finds a quorum."""
        others = [m.addr for m in self.membership.members.values()
                  if m.state == ALIVE and m.id != self.node_id]
        if self.raft is not None:
            me = self.membership.me
            with trio.move_on_after(12):
                try:
                    await self.raft.submit({"op": "member", "node": me.id, "remove": True,
                                            "tx": f"leave/{me.id}/{me.incarnation}"},
                                           timeout=4)
                    if self.raft.status().get("role") == "leader":
                        # pysyncobj refuses a leader's removal of itself, and waiting for a
                        # successor fails in a group of two (one member cannot elect
                        # itself): hand leadership over, then be removed as a follower.
                        await self.raft.step_down()
                    if self.raft.status().get("role") != "leader":
                        for m in list(self.membership.members.values()):
                            if m.state == ALIVE and await self._call(
                                    m.id, {"op": "raft_remove", "raft": self.raft_addr},
                                    max_data=0, timeout=4.0) is not None:
                                break
                except NoQuorum as e:
                    log.warning("could not leave the Raft group cleanly: %s", e)
        await self.membership.leave()
        if self.raft is not None:
            # Confirm the group no longer counts us (if the removal could not commit above,
            # a successor removes us after we stop: the supervisor's _remove_departed), or
            # the next node to leave would take the group below a quorum of the rest.
            self.raft.destroy()
            if others:
                await self._wait_removed(others)
        await self.pool.aclose()

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
                    if isinstance(members, list) and members and \
                            self.raft_addr not in members:
                        log.info("raft: the group removed us")
                        return
                await trio.sleep(0.3)
        log.warning("raft: the group still counted us %.0fs after we left", timeout)

    def raft_status(self) -> dict[str, Any] | None:
        if self.raft is None:
            return None
        st = self.raft.status()
        st["members"] = self.raft.members()
        st["self"] = self.raft_addr
        return st

    # -- serving peers --------------------------------------------------------------------

    def _chunk_args(self, msg: dict[str, Any]) -> tuple[str, str, int, int]:
        key, etag = _str(msg, "key"), _str(msg, "etag")
        size = _int(msg, "size", 0, MAX_OBJECT_SIZE)
        idx = _int(msg, "idx", 0, max(0, (size - 1) // self.chunk_size))
        return key, etag, size, idx

    async def _handle(self, peer: str, msg: dict[str, Any]
                      ) -> tuple[dict[str, Any], bytes | None]:
        op = msg.get("op")
        if op in ("join", "ping", "leave"):
            return self.membership.handle(peer, msg), None
        if op == "read":
            key, etag, size, idx = self._chunk_args(msg)
            start = _int(msg, "start", 0, self.chunk_size)
            length = _int(msg, "len", 0, self.chunk_size)
            data = await self.chunks.serve(key, etag, size, idx, start, length)
            return {"data": len(data)}, data
        if op == "chunk":
            key, etag, size, idx = self._chunk_args(msg)
            if msg.get("cached_only"):
                data = self.chunks.cached_chunk(key, etag, idx)
                if data is None:
                    return {"cached": False}, None
            else:
                data = await self.chunks.serve(key, etag, size, idx, 0, self.chunk_size)
            return {"data": len(data)}, data
        if op == "warm":
            key, etag, size, _ = self._chunk_args(msg)
            idxs = msg.get("idxs")
            last = max(0, (size - 1) // self.chunk_size)
            if (not isinstance(idxs, list) or len(idxs) > 1024
                    or not all(isinstance(i, int) and 0 <= i <= last for i in idxs)):
                raise ProtocolError("request field 'idxs' is not a list of chunk indexes")
            self.chunks.readahead_local(key, etag, size, idxs)
            return {}, None
        if op == "prefetch":
            items = msg.get("items")
            if not isinstance(items, list) or len(items) > MAX_PREFETCH_ITEMS:
                raise ProtocolError("request field 'items' is not a list of chunks")
            refs = []
            for it in items:
                if not (isinstance(it, list) and len(it) == 4):
                    raise ProtocolError("a prefetch item is not [key, etag, size, idx]")
                refs.append(self._chunk_args(dict(zip(("key", "etag", "size", "idx"), it,
                                                      strict=True))))
            results = await self.chunks.ensure_many_local(refs, bool(msg.get("pin")))
            return {"results": results}, None
        if op in ("unpin", "evict"):
            prefix = _str(msg, "prefix")
            if op == "unpin":
                return {"bytes": self.chunks.unpin(prefix)}, None
            dropped, kept = self.chunks.evict(prefix)
            return {"bytes": dropped, "pinned_kept": kept}, None
        if op == "stats":
            return {"stats": self.local_stats()}, None
        if op in ("dread", "dpull"):
            if self.txn is None:
                raise PeerError("this node keeps no dirty data")
            return await self.txn.handle(peer, msg)
        if op == "raft_members":
            return {"members": self.raft.members() if self.raft else []}, None
        if op in ("raft_add", "raft_remove"):
            addr = _str(msg, "raft")
            try:
                split_addr(addr)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
            if self.raft is None:
                raise PeerError("raft is not running here yet")
            if op == "raft_add":
                await self.raft.add_member(addr, timeout=25)
            else:
                await self.raft.remove_member(addr, timeout=25)
            return {"members": self.raft.members()}, None
        raise ProtocolError(f"unknown request {op!r:.50} from {peer}")

    # -- ChunkPeers: what the chunk cache asks ---------------------------------------------

    def owner(self, key: str, etag: str, idx: int) -> str | None:
        node = self.membership.owner(chunk_point(key, etag, idx))
        return None if node == self.node_id else node

    def _cancel_requests_to(self, node: str) -> None:
        for scope in self._inflight.pop(node, ()):
            scope.cancel()

    async def _call(self, node: str, msg: dict[str, Any], max_data: int, timeout: float
                    ) -> tuple[dict[str, Any], bytearray | None] | None:
        """A request to a member; None (and the member routed around) if it cannot answer.
        A reply that is an error the peer reported (it answered) is raised or, when it
        is not about the object, treated as unanswered without suspecting the peer."""
        addr = self.membership.addr_of(node)
        if addr is None:
            return None
        scope = trio.CancelScope()
        self._inflight[node].add(scope)
        try:
            with scope:
                return await self.pool.request(addr, msg, timeout=timeout, max_data=max_data)
            log.info("request %r to %s abandoned: the peer stopped answering", msg["op"], node)
            return None
        except PeerError as e:
            if getattr(e, "code", None) is None:
                self.membership.suspect(node)
            log.info("peer %s could not serve %r, falling back: %s", node, msg["op"], e)
            return None
        finally:
            self._inflight.get(node, set()).discard(scope)

    async def read(self, owner: str, key: str, etag: str, obj_size: int, idx: int,
                   start: int, length: int) -> bytes | None:
        got = await self._call(owner, {"op": "read", "key": key, "etag": etag,
                                       "size": obj_size, "idx": idx, "start": start,
                                       "len": length},
                               max_data=length, timeout=self.request_timeout)
        return None if got is None or got[1] is None else bytes(got[1])

    async def fetch(self, owner: str, key: str, etag: str, obj_size: int, idx: int
                    ) -> bytes | None:
        got = await self._call(owner, {"op": "chunk", "key": key, "etag": etag,
                                       "size": obj_size, "idx": idx},
                               max_data=self.chunk_size, timeout=self.request_timeout)
        return None if got is None else got[1]  # type: ignore[return-value]

    async def from_previous(self, key: str, etag: str, obj_size: int, idx: int
                            ) -> bytes | None:
        for m in self.membership.previous_owners(chunk_point(key, etag, idx)):
            got = await self._call(m.id, {"op": "chunk", "key": key, "etag": etag,
                                          "size": obj_size, "idx": idx, "cached_only": True},
                                   max_data=self.chunk_size, timeout=self.request_timeout)
            if got is not None and got[1] is not None:
                log.debug("chunk %d of %r came from previous owner %s", idx, key, m.id)
                return got[1]  # type: ignore[return-value]
        return None

    def readahead(self, owner: str, key: str, etag: str, obj_size: int, idxs: list[int]
                  ) -> None:
        # A sequential reader asks on every read; tell each owner about a chunk once.
        now = time.monotonic()
        fresh = [i for i in idxs if now - self._warmed.get((key, etag, i), -WARM_AGAIN) >=
                 WARM_AGAIN]
        if not fresh or self._nursery is None:
            return
        for i in fresh:
            self._warmed[(key, etag, i)] = now
            self._warmed.move_to_end((key, etag, i))
        while len(self._warmed) > 4096:
            self._warmed.popitem(last=False)
        self._nursery.start_soon(self._call, owner,
                                 {"op": "warm", "key": key, "etag": etag, "size": obj_size,
                                  "idx": fresh[0], "idxs": fresh}, 0, 5.0)

    async def ensure_many_remote(self, owner: str, items: list[tuple[str, str, int, int]],
                          pin: bool) -> list[str] | None:
        results: list[str] = []
        for start in range(0, len(items), MAX_PREFETCH_ITEMS):
            part = items[start:start + MAX_PREFETCH_ITEMS]
            got = await self._call(owner, {"op": "prefetch", "items": [list(i) for i in part],
                                           "pin": pin}, max_data=0, timeout=PREFETCH_TIMEOUT)
            res = None if got is None else got[0].get("results")
            if not (isinstance(res, list) and len(res) == len(part)
                    and all(isinstance(r, str) for r in res)):
                return None
            results += res
        return results

    async def broadcast(self, msg: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
        """Send `msg` to every live member (not us); each one's reply, None if it failed."""
        out: dict[str, dict[str, Any] | None] = {}

        async def one(node: str) -> None:
            got = await self._call(node, msg, max_data=0, timeout=30.0)
            out[node] = None if got is None else got[0]

        async with trio.open_nursery() as nursery:
            for node in self.membership.ring.members:
                if node != self.node_id:
                    nursery.start_soon(one, node)
        return out

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "listen": self.listen,
                "members": self.membership.status(), "ring_changes": self.membership.changes,
                "peer_requests_sent": self.pool.requests,
                "peer_request_failures": self.pool.failures,
                "peer_connections_open": self.server.connections,
                "peer_connections_rejected": self.server.rejected}
