"""Prometheus metrics: the latency histograms the layers observe, and a collector that
reads every other figure when Prometheus scrapes.

Histograms (FUSE, S3, peer requests) are observed where the work happens; their `_count`
is the number of operations. Everything else already exists as counters in the components
and is exported at scrape time from a `Snapshot` (objcache.status builds it), so there is
one source of truth and no bookkeeping on the hot path. This module imports nothing of
objcache but errors: every layer may observe a histogram here. The HTTP server runs in
prometheus-client's own thread; snapshots only read plain numbers and copies of dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from objcache.errors import UserError

REGISTRY = CollectorRegistry(auto_describe=True)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
         1, 2.5, 5, 10, 30)
_SLOW = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

FUSE_SECONDS = Histogram("objcache_fuse_operation_seconds",
                         "FUSE operations by op: latency (the _count is the operation count)",
                         ["op"], registry=REGISTRY, buckets=_FAST)
FUSE_ERRORS = Counter("objcache_fuse_errors", "FUSE operations answered with an error",
                      ["op", "errno"], registry=REGISTRY)
S3_SECONDS = Histogram("objcache_s3_request_seconds",
                       "S3 requests by operation: latency of each attempt", ["op"],
                       registry=REGISTRY, buckets=_SLOW)
PEER_SECONDS = Histogram("objcache_peer_request_seconds",
                         "Requests to peers by op: latency (failed ones included)", ["op"],
                         registry=REGISTRY, buckets=_SLOW)


@dataclass
class ClusterSnapshot:
    members_by_state: dict[str, float]
    ring_changes: int
    peer_request_failures: int
    peer_fallbacks: int
    peer_served_bytes: int
    peer_connections: int
    peer_connections_rejected: int
    raft: dict[str, Any] | None  # role, term, commit_index, apply_lag, members


@dataclass
class Snapshot:
    """Every figure the collector exports, read at scrape time."""

    read_bytes: dict[str, float]  # by source: cache, peer, s3
    cache_used: int
    cache_capacity: int
    cache_pinned: int
    cache_near: int
    cache_chunks: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_uncached_reads: int
    write_waits: int  # writes that waited for write-back to free room
    write_wait_seconds: float
    s3_requests: dict[str, int]
    s3_errors: dict[str, int]
    s3_retries: dict[str, int]
    s3_bytes: dict[str, float]  # by direction: down, up
    dirty_files: int
    dirty_bytes: int
    flush_lag: float
    uploads: int
    upload_failures: int
    quarantined: int
    prefetch_files: dict[str, float]  # by result: ok, failed
    prefetch_bytes: int
    cluster: ClusterSnapshot | None = field(default=None)


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None
             ) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _by(family: CounterMetricFamily | GaugeMetricFamily, label_values: dict[str, float]
        ) -> CounterMetricFamily | GaugeMetricFamily:
    for label, v in sorted(label_values.items()):
        family.add_metric([label], v)
    return family


class SnapshotCollector:
    """Exports a Snapshot taken at scrape time."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield _by(CounterMetricFamily("objcache_read_bytes", "Bytes read through the "
                                      "daemon (page-cache hits never reach it) by source",
                                      labels=["source"]), s.read_bytes)
        yield _gauge("objcache_cache_used_bytes", "Cache bytes in use (chunks + local files)",
                     s.cache_used)
        yield _gauge("objcache_cache_capacity_bytes", "Cache capacity (--cache-size)",
                     s.cache_capacity)
        yield _gauge("objcache_cache_pinned_bytes", "Bytes pinned by prefetch --pin",
                     s.cache_pinned)
        yield _gauge("objcache_cache_near_bytes", "Bytes of other nodes' hot chunks kept here",
                     s.cache_near)
        yield _gauge("objcache_cache_chunks", "Chunks in the cache", s.cache_chunks)
        yield _counter("objcache_cache_hits", "Chunk lookups found in this node's cache",
                       s.cache_hits)
        yield _counter("objcache_cache_misses", "Chunk lookups not in this node's cache",
                       s.cache_misses)
        yield _counter("objcache_cache_evictions", "Chunks or clean files evicted for room",
                       s.cache_evictions)
        yield _counter("objcache_cache_uncached_reads", "Reads served from S3 without caching "
                       "(cache full of pinned or dirty data)", s.cache_uncached_reads)
        yield _counter("objcache_write_waits", "Writes that waited for write-back to free "
                       "cache space (backpressure)", s.write_waits)
        yield _counter("objcache_write_wait_seconds", "Time writers spent waiting for "
                       "write-back to free cache space", s.write_wait_seconds)
        # errors and retries get a zero for every op seen, so rate() works from the first
        # failure on
        errors = dict.fromkeys(s.s3_requests, 0) | s.s3_errors
        retries = dict.fromkeys(s.s3_requests, 0) | s.s3_retries
        for name, doc, values in (
                ("objcache_s3_requests", "S3 requests (attempts) by operation",
                 s.s3_requests),
                ("objcache_s3_errors", "Failed S3 attempts by operation", errors),
                ("objcache_s3_retries", "Retried S3 requests by operation", retries)):
            yield _by(CounterMetricFamily(name, doc, labels=["op"]), values)
        yield _by(CounterMetricFamily("objcache_s3_bytes", "Bytes moved to and from S3",
                                      labels=["direction"]), s.s3_bytes)
        yield _gauge("objcache_dirty_files", "Files written and not yet in S3", s.dirty_files)
        yield _gauge("objcache_dirty_bytes", "Bytes of files not yet in S3", s.dirty_bytes)
        yield _gauge("objcache_flush_lag_seconds", "Age of the oldest change not yet in S3",
                     s.flush_lag)
        yield _counter("objcache_uploads", "Files uploaded by write-back", s.uploads)
        yield _counter("objcache_upload_failures", "Write-back uploads that failed (retried)",
                       s.upload_failures)
        yield _gauge("objcache_quarantined_files", "Files S3 refused for good, kept in the "
                     "cache dir's lost+found/", s.quarantined)
        yield _by(CounterMetricFamily("objcache_prefetch_files", "Files prefetched through "
                                      "this node, by result", labels=["result"]),
                  s.prefetch_files)
        yield _counter("objcache_prefetch_bytes", "Bytes fetched by prefetch requests "
                       "through this node", s.prefetch_bytes)
        if s.cluster is not None:
            yield from _cluster(s.cluster)


def _cluster(c: ClusterSnapshot) -> Iterator[Metric]:
    yield _by(GaugeMetricFamily("objcache_cluster_members", "Members known to this node "
                                "by state (itself counted alive)", labels=["state"]),
              c.members_by_state)
    yield _counter("objcache_ring_changes", "Changes of this node's ring", c.ring_changes)
    yield _counter("objcache_peer_request_failures", "Requests to peers that failed",
                   c.peer_request_failures)
    yield _counter("objcache_peer_fallbacks", "Peer reads that fell back to S3",
                   c.peer_fallbacks)
    yield _counter("objcache_peer_served_bytes", "Chunk bytes served to peers",
                   c.peer_served_bytes)
    yield _gauge("objcache_peer_connections", "Open inbound peer connections",
                 c.peer_connections)
    yield _counter("objcache_peer_connections_rejected", "Inbound peer connections "
                   "dropped (authentication, protocol, timeout)", c.peer_connections_rejected)
    raft = c.raft
    if raft is not None:
        yield _by(GaugeMetricFamily("objcache_raft_role", "1 for this node's Raft role",
                                    labels=["role"]),
                  {r: float(raft["role"] == r)
                   for r in ("leader", "follower", "candidate", "learner")})
        yield _gauge("objcache_raft_term", "Raft term", raft["term"] or 0)
        yield _gauge("objcache_raft_commit_index", "Raft commit index",
                     raft["commit_index"] or 0)
        yield _gauge("objcache_raft_apply_lag", "Committed Raft entries not applied yet",
                     raft["apply_lag"])
        yield _gauge("objcache_raft_members", "Voters of the Raft group",
                     len(raft["members"]))
        yield _counter("objcache_raft_batches", "Log entries this node sent commands in",
                       raft.get("batches") or 0)
        yield _counter("objcache_raft_batched_commands", "Commands this node sent in those "
                       "entries", raft.get("batched_commands") or 0)


def serve(addr: str, snapshot: Callable[[], Snapshot]) -> Any:
    """Start the /metrics HTTP server on HOST:PORT (before mounting: a taken port is a
    start-up error)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"invalid --metrics-addr {addr!r}: expected HOST:PORT")
    REGISTRY.register(SnapshotCollector(snapshot))
    try:
        server, _ = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0",
                                      registry=REGISTRY)
    except OSError as e:
        raise UserError(f"cannot serve metrics on {addr}: {e.strerror or e}") from None
    return server
