"""What a node reports about itself: `objcache status`, the per-node rows of a cluster's
status, and the figures Prometheus scrapes (objcache.metrics.Snapshot).

It reads the components' own counters; nothing here keeps a number of its own except the
prefetch totals the control handlers add to.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from objcache import __version__
from objcache.metrics import ClusterSnapshot, Snapshot

if TYPE_CHECKING:
    from objcache.backend.base import Backend
    from objcache.cache.chunks import ChunkCache
    from objcache.cluster.node import ClusterNode
    from objcache.cluster.peers import PeerServer, Reply
    from objcache.config import MountConfig
    from objcache.store.s3 import S3Store


@dataclass
class PrefetchTotals:
    ok: int = 0
    failed: int = 0
    bytes: int = 0


class ClusterStatus(Protocol):
    """The cluster's part of status (a null object on a single node)."""

    is_member: bool

    async def status(self, own_row: dict[str, Any], local: bool = False
                     ) -> dict[str, Any] | None: ...

    def snapshot(self, peer_fallbacks: int, served: int) -> ClusterSnapshot | None: ...

    async def broadcast(self, msg: dict[str, Any]) -> dict[str, dict[str, Any] | None]: ...


class FuseStatus(Protocol):
    """The FUSE session's part of status (objcache.fs.operations.FuseReport)."""

    def fuse(self) -> dict[str, Any] | None: ...


class NoFuse:
    def fuse(self) -> dict[str, Any] | None:
        return None


class NoCluster:
    is_member = False

    async def status(self, own_row: dict[str, Any], local: bool = False
                     ) -> dict[str, Any] | None:
        return None

    def snapshot(self, peer_fallbacks: int, served: int) -> ClusterSnapshot | None:
        return None

    async def broadcast(self, msg: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
        return {}


class MemberStatus:
    """A cluster member's part of status: members, ring, peers, Raft, and every member's
    own row (asked with a `stats` request; `local` asks nobody: one request per member is
    too many to poll at hundreds of nodes)."""

    is_member = True

    def __init__(self, node: ClusterNode, server: PeerServer) -> None:
        self.node = node
        self.server = server

    async def status(self, own_row: dict[str, Any], local: bool = False
                     ) -> dict[str, Any] | None:
        st = self.node.status(self.server)
        replies = {} if local else await self.node.client.broadcast({"op": "stats"})
        rows = {self.node.node_id: own_row}
        for node, reply in replies.items():
            stats = reply.get("stats") if reply else None
            rows[node] = stats if isinstance(stats, dict) else None
        for m in st["members"]:
            m["stats"] = rows.get(m["id"])
        st["raft"] = self.node.raft.status()
        st["partition"] = partition(st["node_id"], st["members"], st["raft"],
                                    self._recorded())
        return st

    def _recorded(self) -> list[str]:
        state = self.node.raft.state
        return state.member_ids() if state is not None else []

    def snapshot(self, peer_fallbacks: int, served: int) -> ClusterSnapshot | None:
        ms = self.node.membership
        states: dict[str, float] = {"alive": 1, "suspect": 0, "dead": 0, "left": 0,
                                    "joining": 0}
        for m in list(ms.members.values()):
            state = ms.shown_state(m)
            states[state] = states.get(state, 0) + 1
        return ClusterSnapshot(states, ms.changes, self.node.pool.failures, peer_fallbacks,
                               served, self.server.connections, self.server.rejected,
                               self.node.raft.status())

    async def broadcast(self, msg: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
        return await self.node.client.broadcast(msg)


def partition(me: str, members: list[dict[str, Any]], raft: dict[str, Any] | None,
              recorded: list[str] | None = None) -> dict[str, Any]:
    """Whether this node is cut off from the majority, and from whom: the Raft members
    its member has no connection to, the cluster members it has not heard from (with how
    long ago it last did), and for how long it has been without a majority (the time
    since the last of the members that made one answered). Cut off, the members the Raft
    log records (`recorded`) that membership has not reached count too: one it had only
    heard of when the cut came is forgotten after --peer-timeout, and was missing from
    "from whom" (test_a_failed_close_does_not_take_effect_after_the_heal, in a CI run)."""
    unreachable = [{"id": m["id"], "state": m["state"],
                    "last_seen_seconds": m.get("last_seen_seconds")}
                   for m in members if m["id"] != me and m["state"] in ("suspect", "dead")]
    out: dict[str, Any] = {"cut_off": False, "cut_off_seconds": None,
                           "unreachable": unreachable, "raft_unreachable": []}
    if not raft or not raft.get("members"):
        return out
    group = raft["members"]
    others = [a for a in group if a != raft.get("self")]
    connected = set(raft.get("connected") or [])
    out["raft_unreachable"] = [a for a in others if a not in connected]
    # others needed for a majority: with our vote, or (a learner) without it
    need = len(group) // 2 if raft.get("self") in group else len(group) // 2 + 1
    if len(connected & set(others)) >= need:
        return out
    out["cut_off"] = True
    alive = {m["id"] for m in members if m["state"] == "alive"}
    listed = {u["id"] for u in unreachable}
    unreachable += [{"id": n, "state": "not reached", "last_seen_seconds": None}
                    for n in recorded or [] if n != me and n not in alive | listed]
    # Lost when the need-th most recently seen member went silent.
    seen = sorted((m.get("last_seen_seconds") for m in members
                   if m["id"] != me and m["state"] not in ("left",)
                   and m.get("last_seen_seconds") is not None), key=float)
    if need and len(seen) >= need:
        out["cut_off_seconds"] = seen[need - 1]
    return out


def _hit_ratio(cache: ChunkCache) -> float | None:
    st = cache.stats
    reads = st.hits + st.misses
    return round(st.hits / reads, 4) if reads else None


class NodeRow:
    """This node's row of the cluster-wide status (also served to peers: `stats`)."""

    def __init__(self, store: S3Store, cache: ChunkCache, backend: Backend) -> None:
        self.store = store
        self.cache = cache
        self.backend = backend

    def row(self) -> dict[str, Any]:
        c = self.cache
        wb = self.backend.stats()
        s3 = self.store.stats
        return {"cache_used_bytes": c.used, "cache_capacity_bytes": c.capacity,
                "pinned_bytes": c.pinned_bytes, "dirty_files": wb.dirty_files,
                "dirty_bytes": wb.dirty_bytes, "oldest_dirty_seconds": wb.oldest_dirty_seconds,
                "hit_ratio": _hit_ratio(c),
                "s3_requests": sum(s3.requests.values()),
                "s3_errors": sum(s3.errors.values())}

    async def serve(self, peer: str, msg: dict[str, Any]) -> Reply:
        return {"stats": self.row()}, None


class NodeStatus:
    def __init__(self, cfg: MountConfig, mountpoint: str, cache_dir: str, rows: NodeRow,
                 cluster: ClusterStatus, fuse: FuseStatus | None = None) -> None:
        self.cfg = cfg
        self.fuse = fuse or NoFuse()
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.rows = rows
        self.store = rows.store
        self.cache = rows.cache
        self.backend = rows.backend
        self.cluster = cluster
        self.prefetch = PrefetchTotals()
        self.started = time.time()

    async def status(self, local: bool = False) -> dict[str, Any]:
        c, st = self.cache, self.cache.stats
        wb = self.backend.stats()
        return {
            "ok": True, "version": __version__, "pid": os.getpid(),
            "mountpoint": self.mountpoint,
            "source": f"s3://{self.cfg.bucket}/{self.cfg.prefix}".rstrip("/"),
            "endpoint": self.store.endpoint, "cache_dir": self.cache_dir,
            "uptime_seconds": round(time.time() - self.started, 1),
            "cache": {"used_bytes": c.used, "capacity_bytes": c.capacity,
                      "chunk_bytes": c.chunk_bytes, "local_file_bytes": c.local_bytes,
                      "chunks": c.chunk_count(), "chunks_landing": c.chunks_landing(),
                      "hits": st.hits, "misses": st.misses,
                      "evictions": st.evictions, "uncached_reads": st.bypass,
                      "bytes_read_from_cache": st.bytes_from_cache,
                      "bytes_read_from_s3": st.bytes_from_s3,
                      "bytes_read_from_peers": st.bytes_from_peers,
                      "bytes_fetched_from_peers": st.bytes_fetched_from_peers,
                      "corrupt_chunks": st.corrupt,
                      "write_waits": st.write_waits,
                      "write_wait_seconds": round(st.write_wait_seconds, 3),
                      "writers_waiting": c.waiting_for_room,
                      "peer_fallbacks": st.peer_fallbacks,
                      "bytes_served_to_peers": st.bytes_served_to_peers,
                      "pinned_bytes": c.pinned_bytes, "near_cache_bytes": c.near_bytes,
                      "near_cache_capacity_bytes":
                          c.near_capacity if self.cluster.is_member else 0,
                      "hit_ratio": _hit_ratio(c)},
            "dirty": {"files": wb.dirty_files, "bytes": wb.dirty_bytes,
                      "oldest_age_seconds": wb.oldest_dirty_seconds,
                      # refused by S3 for good: in the cache dir's lost+found/
                      "quarantined": wb.quarantined},
            "writeback": {"uploaded_files": wb.uploaded, "failed_uploads": wb.failed,
                          "streamed_files": wb.streamed,
                          "stream_fallbacks": wb.stream_fallbacks},
            "s3": self.store.stats.as_dict(),
            "fuse": self.fuse.fuse(),
            "transactions": {"in_doubt": list(wb.in_doubt), "settled": list(wb.settled)},
            "cluster": await self.cluster.status(self.rows.row(), local),
        }

    def snapshot(self) -> Snapshot:
        """Everything Prometheus scrapes (called on the metrics server's thread: reads
        plain numbers and copies)."""
        c, st, s3 = self.cache, self.cache.stats, self.store.stats
        wb = self.backend.stats()
        return Snapshot(
            read_bytes={"cache": st.bytes_from_cache, "peer": st.bytes_from_peers,
                        "s3": st.bytes_from_s3},
            cache_used=c.used, cache_capacity=c.capacity, cache_pinned=c.pinned_bytes,
            cache_near=c.near_bytes, cache_chunks=c.chunk_count(), cache_hits=st.hits,
            cache_misses=st.misses, cache_evictions=st.evictions,
            cache_uncached_reads=st.bypass, write_waits=st.write_waits,
            write_wait_seconds=st.write_wait_seconds,
            s3_requests=dict(s3.requests), s3_errors=dict(s3.errors),
            s3_retries=dict(s3.retries),
            s3_bytes={"down": s3.bytes_in, "up": s3.bytes_out},
            dirty_files=wb.dirty_files, dirty_bytes=wb.dirty_bytes,
            flush_lag=wb.oldest_dirty_seconds or 0.0, uploads=wb.uploaded,
            upload_failures=wb.failed, quarantined=wb.quarantined,
            prefetch_files={"ok": self.prefetch.ok, "failed": self.prefetch.failed},
            prefetch_bytes=self.prefetch.bytes,
            cluster=self.cluster.snapshot(st.peer_fallbacks, st.bytes_served_to_peers))
