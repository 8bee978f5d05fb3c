#!/usr/bin/env python3
"""Long chaos runs of a 3-node cluster on the embedded SeaweedFS, many in a row
(tests/helpers/chaos.py says what one run does and checks).

    .venv/bin/python scripts/chaos.py --runs 20 --seconds 60

Prints one line per run (seed, events, files acknowledged, longest recovery) and exits 1 at
the first failed run, naming its seed (CHAOS_SEED=... reruns it in the short test)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import chaos
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, stop_all, stop_on_signals
from tests.helpers.seaweed import SeaweedFS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: time)")
    args = ap.parse_args()
    stop_on_signals()
    seed0 = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    work = Path(tempfile.mkdtemp(prefix="objcache-chaos-"))
    weed = SeaweedFS(work / "s3")
    weed.start()
    longest = 0.0
    failed = True
    try:
        s3 = weed.client()
        for run in range(args.runs):
            seed = seed0 + run
            bucket = f"chaos-{seed}"
            s3.create_bucket(Bucket=bucket)
            mounts: list[Mount] = []
            root = work / f"run{run}"
            root.mkdir()
            t0 = time.monotonic()
            res = None
            try:
                res = chaos.run(Cluster(weed.endpoint, bucket, root, mounts), s3, bucket,
                                args.seconds, seed)
            finally:
                stop_all(mounts)
                if res is not None and not res.errors:
                    shutil.rmtree(root, ignore_errors=True)
                else:  # the daemons' logs, for the diagnosis
                    print(f"  logs kept in {root}", flush=True)
            longest = max(longest, res.longest_recovery)
            print(f"run {run + 1}/{args.runs} seed {seed}: {'FAILED' if res.errors else 'ok'} "
                  f"in {time.monotonic() - t0:.0f}s, {len(res.events)} events "
                  f"({sum('all' in e for e in res.events)} all-at-once), "
                  f"{res.acknowledged} files acknowledged, {res.unacknowledged} not, "
                  f"longest recovery {res.longest_recovery:.1f}s", flush=True)
            if res.errors:
                for e in res.errors[:20]:
                    print("  " + e)
                return 1
        print(f"{args.runs} runs in a row passed; longest recovery {longest:.1f}s")
        failed = False
        return 0
    finally:
        weed.stop()
        if failed:
            print(f"kept {work} (delete it when done)", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
