"""The Prometheus endpoint: parses as Prometheus text, names follow the conventions, and
the counters move with reads, writes and S3 traffic."""

from __future__ import annotations

import os
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cluster import free_port
from tests.helpers.mount import objcache

MIB = 1 << 20


def _scrape(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(m: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_reads_writes_and_peers(s3, bucket, cluster):  # type: ignore
    body = os.urandom(80 * MIB)
    s3.put_object(Bucket=bucket, Key="m/data.bin", Body=body)
    addr = f"127.0.0.1:{free_port()}"
    a = cluster.add("--chunk-size", "5M", "--metrics-addr", addr, "--writeback-delay", "0")
    b = cluster.add("--chunk-size", "5M")
    cluster.wait_members([a, b], 2)

    cluster.wait_raft([a, b], 2)
    before = _scrape(addr)
    assert _v(before, "objcache_raft_members") == 2 and _v(before, "objcache_raft_term") >= 1
    assert sum(_v(before, "objcache_raft_role", role=r) for r in ("leader", "follower")) == 1
    assert all(name.startswith("objcache_") or name.startswith("python_")
               or name.startswith("process_") for name, _ in before)
    assert _v(before, "objcache_cluster_members", state="alive") == 2
    assert _v(before, "objcache_cache_capacity_bytes") == 1 << 30

    assert (a.mnt / "m" / "data.bin").read_bytes() == body
    (a.mnt / "m" / "out.bin").write_bytes(b"x" * MIB)
    objcache("flush", str(a.mnt))
    after = _scrape(addr)

    read = {src: _v(after, "objcache_read_bytes_total", source=src) for src in
            ("cache", "peer", "s3")}
    assert read["cache"] + read["peer"] == 80 * MIB, read  # local chunks + peers' chunks
    assert read["peer"] > 0 and read["s3"] > 0, read  # b owns some; a fetched its own
    assert _v(after, "objcache_fuse_operation_seconds_count", op="read") > \
        _v(before, "objcache_fuse_operation_seconds_count", op="read")
    assert _v(after, "objcache_fuse_operation_seconds_count", op="write") >= 1
    assert _v(after, "objcache_s3_requests_total", op="get") >= 1
    assert _v(after, "objcache_s3_request_seconds_count", op="get") >= 1
    assert _v(after, "objcache_peer_request_seconds_count", op="read") >= 1
    assert _v(after, "objcache_uploads_total") >= 1
    assert _v(after, "objcache_s3_bytes_total", direction="up") >= MIB
    assert _v(after, "objcache_dirty_files") == 0
    # A lookup of a missing name is counted as an error of its op.
    assert not (a.mnt / "m" / "nope").exists()
    assert _v(_scrape(addr), "objcache_fuse_errors_total", op="lookup", errno="ENOENT") >= 1


def test_metrics_port_in_use_is_a_startup_error(bucket, seaweed, tmp_path):  # type: ignore
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "mnt").mkdir()
        r = objcache("mount", f"s3://{bucket}", str(tmp_path / "mnt"), "--endpoint-url",
                     seaweed.endpoint, "--cache-dir", str(tmp_path / "c"), "--metrics-addr",
                     f"127.0.0.1:{port}", check=False)
    assert r.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr


def test_the_grafana_dashboard_only_uses_exported_metrics(s3, bucket, cluster):  # type: ignore
    import json
    import re
    from pathlib import Path
    dash = Path(__file__).parents[2] / "deploy" / "grafana" / "objcache-dashboard.json"
    exprs = [t["expr"] for p in json.loads(dash.read_text())["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"objcache_[a-z0-9_]+", e)}
    addr = f"127.0.0.1:{free_port()}"
    a = cluster.add("--metrics-addr", addr)
    cluster.wait_members([a, cluster.add()], 2)  # heartbeats are peer requests
    (a.mnt / "f").write_bytes(b"x")  # so that per-op series exist
    (a.mnt / "f").read_bytes()
    objcache("prefetch", str(a.mnt))
    exported = {name for name, _ in _scrape(addr)}
    missing = used - exported
    assert not missing, missing
