"""Idle RSS of every daemon of an N-node cluster after a load, for two checkouts of the code
in one run (issue 28's target: any daemon < 150 MB idle). The clusters run one after the
other (never 2N daemons at once), each on its own bucket of one SeaweedFS:

- N daemons (the default 5 voters, the rest learners), 8 MiB chunks;
- `--writers` threads on each node but the first (on the only one, with -n 1) create
  1 KiB files for `--seconds`;
- every node reads one 64 MiB object nobody read before, at once (each chunk fetched by
  its owner and served to the others over the peer protocol);
- `--idle` seconds of rest (chunk buffers are released after 5 s unused), then each
  daemon's VmRSS / RssAnon, and its Raft role.

Run (under the machine lock), comparing the checkout at OLD with this one:
  flock -x /work/coord/machine.lock .venv/bin/python -m benchmarks.rss --old /path/to/old
The daemons run `python -m objcache` with PYTHONPATH set to each checkout (and the working
directory outside both), so each cluster runs its own code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.scale import Writers, rss_mb, status
from benchmarks.single_node import MiB, read_file, remove_workdir
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, stop_all
from tests.helpers.seaweed import SeaweedFS

KiB = 1 << 10
FLAGS = ("--chunk-size", "8M", "--log-level", "info")


def start(cluster: Cluster, n: int) -> list[Mount]:
    nodes = [cluster.add(*FLAGS, start=False) for _ in range(n)]
    nodes[0].start(timeout=60)
    for i in range(1, n, 4):
        ts = [threading.Thread(target=m.start, kwargs={"timeout": 60}) for m in nodes[i:i + 4]]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return nodes


def settled(nodes: list[Mount], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        sts = [status(m) for m in nodes]
        rafts = [s["cluster"]["raft"] or {} for s in sts]
        if (all(sum(1 for x in s["cluster"]["members"] if x["state"] in ("self", "alive"))
                == len(nodes) for s in sts)
                and len({r.get("leader") for r in rafts}) == 1 and rafts[0].get("leader")
                and all(len(r.get("voters", [])) == min(5, len(nodes)) for r in rafts)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster did not settle: {[r.get('role') for r in rafts]}")
        time.sleep(0.3)


def write_files(nodes: list[Mount], writers: int, seconds: float) -> int:
    writing = Writers(nodes, writers, "w")
    writing.start()
    time.sleep(seconds)
    return writing.stop()


def one(label: str, code: Path, weed: SeaweedFS, work: Path, args: argparse.Namespace
        ) -> dict[str, Any]:
    os.environ["PYTHONPATH"] = str(code)
    bucket = f"rss-{label}"
    s3 = weed.client()
    s3.create_bucket(Bucket=bucket)
    src = work / "cold.src"
    src.write_bytes(os.urandom(64 * MiB))
    s3.upload_file(str(src), bucket, "cold64")
    src.unlink()
    mounts: list[Mount] = []
    (work / label).mkdir()
    cluster = Cluster(weed.endpoint, bucket, work / label, mounts)
    t0 = time.perf_counter()
    try:
        nodes = start(cluster, args.n)
        settled(nodes)
        started = time.perf_counter() - t0
        closes = write_files(nodes[1:] or nodes, args.writers, args.seconds)
        t1 = time.perf_counter()
        ts = [threading.Thread(target=read_file, args=(m.mnt / "cold64",)) for m in nodes]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        read_s = time.perf_counter() - t1
        time.sleep(args.idle)
        pids = [m.proc.pid for m in nodes if m.proc is not None]
        roles = [(status(m)["cluster"]["raft"] or {}).get("role", "?") for m in nodes]
        rss = [round(rss_mb(p), 1) for p in pids]
        anon = [round(rss_mb(p, "RssAnon"), 1) for p in pids]
        return {"code": str(code), "start_s": round(started, 1), "closes": closes,
                "cold_read_s": round(read_s, 2), "rss_max_mb": max(rss),
                "rss_median_mb": statistics.median(rss), "anon_max_mb": max(anon),
                "per_daemon": [{"role": r, "rss_mb": x, "anon_mb": a}
                               for r, x, a in zip(roles, rss, anon, strict=True)]}
    finally:
        stop_all(mounts, grace=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the checkout to compare with")
    ap.add_argument("-n", type=int, default=8, help="daemons per cluster (8)")
    ap.add_argument("--writers", type=int, default=2, help="writer threads per node (2)")
    ap.add_argument("--seconds", type=float, default=8, help="seconds of writes (8)")
    ap.add_argument("--idle", type=float, default=12, help="seconds at rest before RSS (12)")
    ap.add_argument("--workdir", default=None, help="where the run's files go")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="objcache-rss-", dir=args.workdir))
    os.chdir(work)  # `python -m objcache` must not find a checkout in the working directory
    weed = SeaweedFS(work)
    weed.start()
    out: dict[str, Any] = {"n": args.n}
    try:
        for label, code in (("before", args.old.resolve()), ("after", here)):
            out[label] = one(label, code, weed, work, args)
            print(json.dumps({label: out[label]}), flush=True)
    finally:
        weed.stop()
        with open("/proc/self/mounts") as f:
            live = [line.split()[1] for line in f if line.split()[1].startswith(str(work))]
        if live:
            print(f"not removing {work}: still mounted: {live}")
        else:
            remove_workdir(work)
    for label in ("before", "after"):
        r = out[label]
        print(f"{label}: RSS max {r['rss_max_mb']} MB (RssAnon {r['anon_max_mb']}), median "
              f"{r['rss_median_mb']} MB; {r['closes']} closes, cold read {r['cold_read_s']} s")


if __name__ == "__main__":
    main()
