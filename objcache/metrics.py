"""Prometheus metrics: the latency histograms the layers observe, and a collector that
reads every other figure from the daemon's own counters when Prometheus scrapes.

Histograms (FUSE, S3, peer requests) are observed where the work happens; their `_count`
is the number of operations. Everything else (bytes by source, cache, dirty state, S3
request/error/retry counts, cluster, prefetch) already exists as counters in the
components and is exported at scrape time, so there is one source of truth and no
bookkeeping on the hot path. The HTTP server runs in prometheus-client's own thread;
the collector only reads plain ints and takes snapshots of dicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from objcache.errors import UserError

if TYPE_CHECKING:
    from objcache.daemon import Daemon

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


class DaemonCollector:
    """Reads the daemon's counters at scrape time."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.d
        c, st = d.chunks, d.chunks.stats
        yield _by(CounterMetricFamily("objcache_read_bytes", "Bytes read through the "
                                      "daemon (page-cache hits never reach it) by source",
                                      labels=["source"]),
                  {"cache": st.bytes_from_cache, "peer": st.bytes_from_peers,
                   "s3": st.bytes_from_s3})
        yield _gauge("objcache_cache_used_bytes", "Cache bytes in use (chunks + local files)",
                     c.used)
        yield _gauge("objcache_cache_capacity_bytes", "Cache capacity (--cache-size)",
                     c.capacity)
        yield _gauge("objcache_cache_pinned_bytes", "Bytes pinned by prefetch --pin",
                     c.pinned_bytes)
        yield _gauge("objcache_cache_near_bytes", "Bytes of other nodes' hot chunks kept here",
                     c.near_bytes)
        yield _gauge("objcache_cache_chunks", "Chunks in the cache", c.chunk_count())
        yield _counter("objcache_cache_hits", "Chunk lookups found in this node's cache",
                       st.hits)
        yield _counter("objcache_cache_misses", "Chunk lookups not in this node's cache",
                       st.misses)
        yield _counter("objcache_cache_evictions", "Chunks or clean files evicted for room",
                       st.evictions)
        yield _counter("objcache_cache_uncached_reads", "Reads served from S3 without caching "
                       "(cache full of pinned or dirty data)", st.bypass)

        s3 = d.store.stats
        requests = dict(s3.requests)  # errors and retries get a zero for every op seen,
        errors = dict.fromkeys(requests, 0) | dict(s3.errors)  # so rate() works from the
        retries = dict.fromkeys(requests, 0) | dict(s3.retries)  # first failure on
        for name, doc, values in (
                ("objcache_s3_requests", "S3 requests (attempts) by operation", requests),
                ("objcache_s3_errors", "Failed S3 attempts by operation", errors),
                ("objcache_s3_retries", "Retried S3 requests by operation", retries)):
            yield _by(CounterMetricFamily(name, doc, labels=["op"]), values)
        yield _by(CounterMetricFamily("objcache_s3_bytes", "Bytes moved to and from S3",
                                      labels=["direction"]),
                  {"down": s3.bytes_in, "up": s3.bytes_out})

        dirty_files, dirty_bytes, oldest_age = d.dirty_summary()
        yield _gauge("objcache_dirty_files", "Files written and not yet in S3", dirty_files)
        yield _gauge("objcache_dirty_bytes", "Bytes of files not yet in S3", dirty_bytes)
        yield _gauge("objcache_flush_lag_seconds", "Age of the oldest change not yet in S3",
                     oldest_age or 0.0)
        uploaded, failed_uploads = d.upload_counts()
        yield _counter("objcache_uploads", "Files uploaded by write-back", uploaded)
        yield _counter("objcache_upload_failures", "Write-back uploads that failed (retried)",
                       failed_uploads)

        done, failed, fetched = d.prefetch_stats
        yield _by(CounterMetricFamily("objcache_prefetch_files", "Files prefetched through "
                                      "this node, by result", labels=["result"]),
                  {"ok": done, "failed": failed})
        yield _counter("objcache_prefetch_bytes", "Bytes fetched by prefetch requests "
                       "through this node", fetched)

        if d.cluster is not None:
            yield from self._cluster(d)

    @staticmethod
    def _cluster(d: Daemon) -> Iterator[Metric]:
        cl = d.cluster
        assert cl is not None
        st = d.chunks.stats
        states: dict[str, float] = {"alive": 1, "suspect": 0, "dead": 0, "left": 0,
                                    "joining": 0}
        for m in list(cl.membership.members.values()):
            state = cl.membership.shown_state(m)
            states[state] = states.get(state, 0) + 1
        yield _by(GaugeMetricFamily("objcache_cluster_members", "Members known to this node "
                                    "by state (itself counted alive)", labels=["state"]),
                  states)
        yield _counter("objcache_ring_changes", "Changes of this node's ring",
                       cl.membership.changes)
        yield _counter("objcache_peer_request_failures", "Requests to peers that failed",
                       cl.pool.failures)
        yield _counter("objcache_peer_fallbacks", "Peer reads that fell back to S3",
                       st.peer_fallbacks)
        yield _counter("objcache_peer_served_bytes", "Chunk bytes served to peers",
                       st.bytes_served_to_peers)
        yield _gauge("objcache_peer_connections", "Open inbound peer connections",
                     cl.server.connections)
        yield _counter("objcache_peer_connections_rejected", "Inbound peer connections "
                       "dropped (authentication, protocol, timeout)", cl.server.rejected)
        raft = cl.raft_status()
        if raft is not None:
            yield _by(GaugeMetricFamily("objcache_raft_role", "1 for this node's Raft role",
                                        labels=["role"]),
                      {r: float(raft["role"] == r) for r in ("leader", "follower", "candidate")})
            yield _gauge("objcache_raft_term", "Raft term", raft["term"] or 0)
            yield _gauge("objcache_raft_commit_index", "Raft commit index",
                         raft["commit_index"] or 0)
            yield _gauge("objcache_raft_apply_lag", "Committed Raft entries not applied yet",
                         raft["apply_lag"])
            yield _gauge("objcache_raft_members", "Members of the Raft group",
                         len(raft["members"]))


def serve(addr: str, daemon: Daemon) -> Any:
    """Start the /metrics HTTP server on HOST:PORT (before mounting: a taken port is a
    start-up error)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"invalid --metrics-addr {addr!r}: expected HOST:PORT")
    REGISTRY.register(DaemonCollector(daemon))
    try:
        server, _ = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0",
                                      registry=REGISTRY)
    except OSError as e:
        raise UserError(f"cannot serve metrics on {addr}: {e.strerror or e}") from None
    return server

