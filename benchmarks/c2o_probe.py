"""A close-to-open probe at one cluster size: N daemons started once (as in
`benchmarks.scale`), then `--rounds` x 200 round trips at rest (1 KiB written and closed on
one learner, opened and read on another; batches of 50, each flushed after it), for A/B
runs of one change that are quicker and steadier than a whole scale run. (Below 7 nodes,
with 5 voters, the writer and the reader are voters that do not lead.)

Prints p50 / p95 / p99 / max of the round trips, p99 of each 200 in turn (a tail that grows
over the run shows there), and all daemons' CPU per round trip by role (the Raft leader,
the follower voters, the writer, the reader, the other learners), and the leader's read
index counts (answered, and of them under its lease).

    python -m benchmarks.c2o_probe [--nodes 32] [--rounds 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import scale as S
from benchmarks.single_node import remove_workdir
from tests.helpers.mount import Mount, stop_all
from tests.helpers.seaweed import SeaweedFS

BATCH = 50


def probe(sc: S.Scale, rounds: int) -> dict[str, Any]:
    a, b = sc.non_voters()[-2:]
    leader = sc.leader()
    voters = set(sc.voter_addrs())

    def role(m: Mount) -> str:
        if m is leader:
            return "leader"
        if m is a:
            return "writer"
        if m is b:
            return "reader"
        return "follower" if S.raft_addr(m) in voters else "learner"

    roles = {sc.pid(m): role(m) for m in sc.nodes}
    data = os.urandom(1024)
    (a.mnt / "c2o").mkdir()
    os.listdir(b.mnt / "c2o")
    trips: list[float] = []
    by_role: dict[str, float] = {}
    for k in range(rounds * 200 // BATCH + 1):  # (the first batch warms up, untimed)
        sub = f"c2o/b{k}"
        (a.mnt / sub).mkdir()
        os.listdir(b.mnt / sub)
        before = {p: S.cpu_seconds(p) for p in roles}
        for i in range(BATCH):
            (a.mnt / sub / f"f{i}").write_bytes(data)
            t1 = time.perf_counter()
            with open(b.mnt / sub / f"f{i}", "rb") as f:
                got = f.read()
            t2 = time.perf_counter()
            if got != data:
                raise AssertionError(f"{sub}/f{i}: read {len(got)} bytes, not what was closed")
            if k > 0:
                trips.append(t2 - t1)
        if k > 0:
            for p, r in roles.items():
                by_role[r] = by_role.get(r, 0.0) + S.cpu_seconds(p) - before[p]
        S.flush(a.mnt / sub)
    n = len(trips)
    reads = ((S.status(leader).get("cluster") or {}).get("raft") or {}).get("read_index")
    return {"round_trips": n,
            "p50_ms": S.ms(S.pct(trips, 50)), "p95_ms": S.ms(S.pct(trips, 95)),
            "p99_ms": S.ms(S.pct(trips, 99)), "max_ms": S.ms(max(trips)),
            "p99_per_200_ms": [S.ms(S.pct(trips[i:i + 200], 99)) for i in range(0, n, 200)],
            "cpu_ms_per_trip": {r: round(v / n * 1e3, 2) for r, v in sorted(by_role.items())},
            "cpu_ms_per_trip_all": round(sum(by_role.values()) / n * 1e3, 2),
            "leader_read_index": reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="200 round trips each")
    ap.add_argument("--voters", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.nodes < 3:
        ap.error("--nodes must be at least 3 (a leader, a writer and a reader)")
    work = Path(tempfile.mkdtemp(prefix="objcache-c2o-"))
    weed = SeaweedFS(work)
    weed.start()
    sc = S.Scale(work, weed, ("--cache-size", "4G", "--chunk-size", "8M",
                              "--log-level", "info"), args.voters)
    try:
        weed.client().create_bucket(Bucket="scale")
        sc.grow_to(args.nodes)
        out = probe(sc, args.rounds)
    finally:
        stop_all(sc.mounts, grace=5)
        weed.stop()
        remove_workdir(work)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
