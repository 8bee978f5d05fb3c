#!/usr/bin/env python3
"""Long runs of the partition nemesis (tests/helpers/partition.py says what one run does
and checks), many in a row, each on fresh test hosts (tests/helpers/netns.py). Needs root.

    flock -x /work/coord/machine.lock .venv/bin/python scripts/partitions.py --nodes 3 --runs 10

Prints one line per run (seed, faults, operations, EIOs) and exits 1 at the first failed
run, naming its seed (PARTITION_SEED=... reruns it in the short test, --seed here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import netns, partition
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, stop_all, stop_on_signals
from tests.helpers.seaweed import SeaweedFS


def _save_history(path: Path, res: partition.Result) -> None:
    """A kept run's faults and operations, one JSON object a line (times are wall-clock
    seconds), so a failed run's verdict can be checked against what happened."""
    with path.open("w") as f:
        for e in res.events:
            f.write(json.dumps({"fault": dataclasses.asdict(e)}) + "\n")
        for op in sorted(res.ops, key=lambda o: o.t0):
            f.write(json.dumps({"op": dataclasses.asdict(op)}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--voters", type=int, default=None,
                    help="at most this many members vote; the others are learners "
                    "(default: all)")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: time)")
    ap.add_argument("--verbose", action="store_true", help="print every fault and EIO")
    ap.add_argument("--flag", action="append", default=[],
                    help="an extra daemon flag (repeat it: --flag=--raft-compact-entries "
                    "--flag=200)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep every run's daemon logs, not only a failed run's")
    args = ap.parse_args()
    stop_on_signals()
    why = netns.why_not()
    if why:
        print(f"partitions: cannot make test hosts: {why}", file=sys.stderr)
        return 2
    seed0 = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    work = Path(tempfile.mkdtemp(prefix="objcache-partitions-"))
    weed = SeaweedFS(work / "s3")
    weed.start()
    failed = True
    try:
        s3 = weed.client()
        for run in range(args.runs):
            seed = seed0 + run
            bucket = f"part-{seed}"
            s3.create_bucket(Bucket=bucket)
            mounts: list[Mount] = []
            root = work / f"run{run}"
            root.mkdir()
            t0 = time.monotonic()
            res = None
            net = netns.TestNet(args.nodes)
            try:
                net.start_s3(weed.port)
                res = partition.run(net, Cluster(weed.endpoint, bucket, root, mounts, net), s3,
                                    bucket, args.seconds, seed, args.nodes,
                                    voters=args.voters, extra_flags=tuple(args.flag))
            except Exception as e:  # (no verdict: the cluster never settled, a start failed)
                print(f"run {run + 1}/{args.runs} nodes {args.nodes} seed {seed}: FAILED "
                      f"before its check: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                raise
            finally:
                stop_all(mounts)
                net.close()
                if res is not None and not res.errors and not args.keep_logs:
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    if res is not None:
                        _save_history(root / "history.jsonl", res)
                    print(f"  logs kept in {root}", flush=True)
            ok = not res.errors
            print(f"run {run + 1}/{args.runs} nodes {args.nodes} voters "
                  f"{args.voters or args.nodes} seed {seed}: "
                  f"{'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s, "
                  f"{res.summary()}", flush=True)
            if args.verbose or not ok:
                for e in res.events:
                    print(f"  fault at {e.t0 - res.t_start:.1f}s: {e.kind} {e.detail} "
                          f"({e.t1 - e.t0:.1f}s)")
                for e in res.eios:
                    print(f"  {e}")
            if not ok:
                for e in res.errors[:30]:
                    print("  VIOLATION " + e)
                return 1
        print(f"{args.runs} runs in a row passed ({args.nodes} nodes, seeds {seed0}.."
              f"{seed0 + args.runs - 1})")
        failed = args.keep_logs  # keeps `work`
        return 0
    finally:
        weed.stop()
        if failed:
            print(f"kept {work} (delete it when done)", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
