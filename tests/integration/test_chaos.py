"""A short chaos run of a 3-node cluster (tests/helpers/chaos.py): writers on every node
while members are killed and restarted (once all at the same moment) and stopped; every
acknowledged file is then readable byte-exact everywhere and in S3. scripts/chaos.py runs
long ones, many in a row.

Not in the default suite yet (OBJCACHE_CHAOS=1 runs it): 2 of 17 runs so far failed (two
acknowledged files with other bytes after a SIGSTOP and a kill -9 of every node; a listing
missing a file being written back), open in issue 18; a suite failing that often would
block every change."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers import chaos


@pytest.mark.skipif(not os.environ.get("OBJCACHE_CHAOS"),
                    reason="set OBJCACHE_CHAOS=1 (see the module docstring)")
def test_chaos_short(cluster, s3, bucket):  # type: ignore[no-untyped-def]
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    res = chaos.run(cluster, s3, bucket, seconds=12, seed=seed)
    print(f"chaos seed {seed}: {len(res.events)} events, {res.acknowledged} files "
          f"acknowledged, longest recovery {res.longest_recovery:.1f}s: {res.events}")
    assert res.acknowledged > 20, res
    assert not res.errors, (seed, res.errors[:10], res.events)
