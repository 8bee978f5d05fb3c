"""Transaction figures for docs/benchmarks.md (issue 4), on a 3-node cluster of daemon
processes on 127.0.0.1 with one SeaweedFS:

- creates/s across 3 nodes: 4 threads per node creating empty files (one `ns.create`
  each), then files with 4 KiB written (create + seal + replicate to a second node +
  `ns.commit`);
- close() on A to visibility on B: B polls for a name A just created (lookup after the
  change is applied on B and the kernel told), and the time of B's open()+read() right
  after A's close() returns (which is correct by construction: open passes a barrier);
- join: a 4th node started while 1024 files are dirty (written, replicated, not uploaded):
  process start to mounted and caught up with the log;
- drain: `objcache drain` of one node with those 1024 dirty files in the cluster, then of
  the others down to zero (every file in S3 after the last).

Run: .venv/bin/python -m benchmarks.txn   (starts its own SeaweedFS on 127.0.0.1)
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.single_node import remove_workdir
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import SeaweedFS

FLAGS = ("--writeback-delay", "3600", "--log-level", "warning")


def parallel_creates(nodes: list[Mount], per_thread: int, threads: int, size: int,
                     tag: str) -> float:
    data = os.urandom(size)

    def work(m: Mount, t: int) -> None:
        d = m.mnt / f"{tag}-{m.mnt.name}-{t}"
        d.mkdir()
        for i in range(per_thread):
            with open(d / f"f{i}", "wb") as f:
                if size:
                    f.write(data)

    ts = [threading.Thread(target=work, args=(m, t)) for m in nodes for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return len(nodes) * threads * per_thread / (time.perf_counter() - t0)


def visibility(a: Mount, b: Mount, rounds: int) -> tuple[list[float], list[float]]:
    seen, open_read = [], []
    (a.mnt / "vis").mkdir()
    os.listdir(b.mnt / "vis")
    for i in range(rounds):
        p = a.mnt / "vis" / f"f{i}"
        p.write_bytes(b"v" * 100)
        t0 = time.perf_counter()
        q = b.mnt / "vis" / f"f{i}"
        with open(q, "rb") as f:
            assert f.read() == b"v" * 100
        open_read.append(time.perf_counter() - t0)
        # Existence of a name B listed before: needs B's apply + kernel invalidation.
        os.unlink(p)
        t0 = time.perf_counter()
        while q.exists():
            time.sleep(0.0005)
        seen.append(time.perf_counter() - t0)
    return seen, open_read


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="objcache-bench-"))
    weed = SeaweedFS(work)
    weed.start()
    mounts: list[Mount] = []
    r: dict[str, object] = {}
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket="bench")
        cluster = Cluster(weed.endpoint, "bench", work, mounts)
        nodes = [cluster.add(*FLAGS) for _ in range(3)]
        cluster.wait_raft(nodes, 3)
        r["creates_per_s_empty"] = round(parallel_creates(nodes, 100, 4, 0, "empty"), 1)
        r["creates_per_s_4k"] = round(parallel_creates(nodes, 50, 4, 4096, "small"), 1)
        seen, open_read = visibility(nodes[0], nodes[1], 50)
        r["unlink_visible_on_b_ms"] = {
            "median": round(statistics.median(seen) * 1e3, 2),
            "p95": round(sorted(seen)[int(len(seen) * 0.95)] * 1e3, 2),
            "max": round(max(seen) * 1e3, 2)}
        r["open_read_on_b_after_close_ms"] = {
            "median": round(statistics.median(open_read) * 1e3, 2),
            "max": round(max(open_read) * 1e3, 2)}

        # 1024 dirty files (64 KiB each), spread over the three writers.
        def dirty(m: Mount, part: int) -> None:
            d = m.mnt / "dirty" / f"p{part}"
            d.mkdir(parents=True)
            for i in range(1024 // 8):
                (d / f"f{i}").write_bytes(os.urandom(64 << 10))
        (nodes[0].mnt / "dirty").mkdir()
        ts = [threading.Thread(target=dirty, args=(nodes[p % 3], p)) for p in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        st = nodes[0].status()
        r["dirty_entries_before_join"] = sum(
            (m.get("stats") or {}).get("dirty_files", 0) for m in st["cluster"]["members"])
        t0 = time.perf_counter()
        joiner = cluster.add(*FLAGS)
        r["join_s_1024_dirty"] = round(time.perf_counter() - t0, 2)
        assert len(os.listdir(joiner.mnt / "dirty" / "p5")) == 128
        nodes.append(joiner)
        drains = []
        for m in nodes:
            t0 = time.perf_counter()
            out = objcache("drain", str(m.mnt), timeout=600)
            drains.append({"node": m.mnt.name, "seconds": round(time.perf_counter() - t0, 2),
                           "cli": out.stdout.strip()})
        r["drains_to_zero"] = drains
        keys = sum(len(p.get("Contents", [])) for p in s3.get_paginator(
            "list_objects_v2").paginate(Bucket="bench", Prefix="dirty/"))
        r["objects_in_s3_after_zero"] = keys
    finally:
        for m in mounts:
            m.stop()
        weed.stop()
        remove_workdir(work)
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
