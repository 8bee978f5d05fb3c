"""A short chaos run of a 3-node cluster (tests/helpers/chaos.py): writers on every node
while members are killed and restarted (once all at the same moment) and stopped; every
acknowledged file is then readable byte-exact everywhere and in S3. scripts/chaos.py runs
long ones, many in a row.

In the default suite: scripts/chaos.py passed 20 runs in a row (issue 18) once the three
defects earlier runs found were fixed (a slow write of an older version landing over a
newer one in S3, two listing races). CHAOS_SEED=... reruns a seed."""

from __future__ import annotations

import os
import time

from tests.helpers import chaos


def test_chaos_short(cluster, s3, bucket):  # type: ignore[no-untyped-def]
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    print(f"chaos seed {seed} (CHAOS_SEED={seed} repeats this run)", flush=True)
    res = chaos.run(cluster, s3, bucket, seconds=12, seed=seed)
    print(f"chaos seed {seed}: {len(res.events)} events, {res.acknowledged} files "
          f"acknowledged, longest recovery {res.longest_recovery:.1f}s: {res.events}")
    assert res.acknowledged > 20, res
    assert not res.errors, (seed, res.errors[:10], res.events)
