"""This daemon as a cluster member: its identity, and the cluster parts it is made of.

- membership (objcache.cluster.membership): who is in the cluster and alive, the ring;
- peer requests (objcache.cluster.client): calls to members, routed around silent ones;
- chunk placement (objcache.cluster.placement): who owns a chunk, asking owners for it;
- the Raft group (objcache.cluster.raftgroup): getting into the one group and leaving it;
- the members it has seen, kept in the cache dir (PEERS_FILE) and used as seeds at its next
  start besides --peers. Without them a node configured with no peers (the first one) that
  had become a learner (which keeps no Raft state on disk) formed a group of one when
  restarted and served an empty namespace until it found the cluster (a read of an
  acknowledged file gave ENOENT: the partition nemesis with learners, seed 4302).

What the node answers to peers is composed by the daemon (objcache.cluster.peers.Routes):
membership and Raft requests from here, chunk requests from objcache.cluster.chunkservice,
dirty-blob requests from objcache.txn.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from objcache.cluster.client import Inflight, PeerClient
from objcache.cluster.membership import ALIVE, JOIN_PATIENCE, Member, Membership
from objcache.cluster.peers import Handler, PeerPool, PeerServer, Reply, split_addr
from objcache.cluster.placement import ChunkPlacement
from objcache.cluster.raftgroup import RaftGroup
from objcache.config import MountConfig
from objcache.errors import UserError
from objcache.raft.node import StateMachine
from objcache.ticks import sleep_ticks

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
PEERS_FILE = "peers.json"  # in the cache dir: members seen, seeds for the next start
REMEMBER_PEERS = 32  # at most this many addresses kept
REMEMBER_EVERY = 10.0  # seconds between looks at whether the members changed


def remembered_peers(path: Path) -> list[str]:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [str(a) for a in got] if isinstance(got, list) else []


def load_secret(path: str | None) -> bytes:
    if not path:
        raise UserError("--listen needs --cluster-secret-file (the shared cluster key)")
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise UserError(f"cluster secret file {path} is not readable: {e.strerror}") from None
    if len(key) < MIN_SECRET_BYTES:
        raise UserError(f"cluster secret file {path} holds {len(key)} bytes; use at least "
                        f"{MIN_SECRET_BYTES} random bytes (e.g. openssl rand -hex 32)")
    return key  # (a file others can read is warned about: config.startup_warnings)


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


class CacheUse(Protocol):
    """What this node tells other members about its cache (status on every node)."""

    @property
    def used(self) -> int: ...


class ClusterNode:
    def __init__(self, cfg: MountConfig, key: bytes, cache: CacheUse, chunk_size: int,
                 raft_dir: Path, new_state: Callable[[], StateMachine],
                 extract: Callable[[Any, dict[str, Any]], Any]) -> None:
        assert cfg.listen
        self.node_id = cfg.node_id or cfg.listen
        self.listen = cfg.listen
        self.key = key
        raft_addr = raft_address(cfg)
        # Requests wait as long as an owner may need to fetch from S3; a peer that stops
        # answering heartbeats has its requests cancelled sooner (Inflight).
        self.request_timeout = cfg.s3_retry_seconds + 10
        self.pool = PeerPool(key, self.node_id)
        self._disk = trio.CapacityLimiter(1)  # PEERS_FILE's writes off the trio thread
        inflight = Inflight()
        seeds = [p.strip() for p in (cfg.peers or "").split(",") if p.strip()]
        self._peers_file = raft_dir.parent / PEERS_FILE
        seeds += [a for a in remembered_peers(self._peers_file) if a not in seeds]
        me = Member(self.node_id, cfg.listen, cfg.cache_size, time.time_ns(), raft=raft_addr)
        self.membership = Membership(me, seeds, self.pool, cfg.peer_timeout,
                                     used=lambda: cache.used, on_suspect=inflight.cancel,
                                     overdue=inflight.overdue)
        self.client = PeerClient(self.membership, self.pool, inflight)
        self.placement = ChunkPlacement(self.membership, self.client, chunk_size,
                                        self.request_timeout)
        self.raft: RaftGroup[Any] = RaftGroup(self.membership, self.client, self.pool,
                                              raft_addr, raft_dir, key.hex(), new_state,
                                              extract, cfg.catch_up_seconds,
                                              cfg.raft_voters, cfg.raft_compact_entries)

    def routes(self) -> dict[str, Handler]:
        """The requests this part of the node answers (membership and Raft)."""
        return {"join": self._membership, "ping": self._membership,
                "ping_req": self._membership, "leave": self._membership,
                **self.raft.routes()}

    async def _membership(self, peer: str, msg: dict[str, Any]) -> Reply:
        return await self.membership.handle(peer, msg), None

    async def start(self, nursery: trio.Nursery, sock: socket.socket,
                    server: PeerServer) -> None:
        """Serve peers on `sock`, then join the cluster and its Raft group (raises
        UserError if the secret is refused)."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        await nursery.start(trio.serve_listeners, server.serve_one, [listener])
        await nursery.start(self.placement.run)
        # (a member with a Raft log of its own is in its group whoever answers: it
        # starts at once)
        await self.membership.join(0.0 if self.raft.has_log() else JOIN_PATIENCE)
        nursery.start_soon(self.membership.run)
        nursery.start_soon(self._remember_peers)
        await self.raft.start(nursery)

    async def _remember_peers(self) -> None:
        """Keep PEERS_FILE up to date with the members seen (see the module docstring)."""
        kept: list[str] = remembered_peers(self._peers_file)
        while True:
            me = self.membership.me
            now = sorted(m.addr for m in self.membership.members.values()
                         if m.state == ALIVE and m.id != me.id
                         and m.addr != me.addr)[:REMEMBER_PEERS]
            if now and now != kept:
                await trio.to_thread.run_sync(self._write_peers, now, limiter=self._disk)
                kept = now
            await sleep_ticks(REMEMBER_EVERY)

    def _write_peers(self, addrs: list[str]) -> None:
        tmp = self._peers_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(addrs))
            os.replace(tmp, self._peers_file)
        except OSError as e:  # (a full disk: the next start relies on --peers alone)
            log.warning("could not keep the members' addresses in %s: %s",
                        self._peers_file, e.strerror)

    async def leave(self) -> None:
        """Leave the Raft group and the ring (bounded), and close peer connections."""
        await self.raft.leave()
        await self.membership.leave()
        await self.pool.aclose()

    def close(self) -> None:
        """Stop the Raft member without leaving (the process is going away)."""
        self.raft.close()

    def status(self, server: PeerServer) -> dict[str, Any]:
        return {"node_id": self.node_id, "listen": self.listen,
                "members": self.membership.status(), "ring_changes": self.membership.changes,
                "peer_requests_sent": self.pool.requests,
                "peer_requests_by_op": dict(self.pool.by_op),
                "membership_probes": self.membership.probes,
                "peer_request_failures": self.pool.failures,
                "peer_connections_open": server.connections,
                "peer_connections_rejected": server.rejected}
