"""A bounded chaos run against a real cluster: writers on every node while members are
killed (-9) and restarted with their cache dirs, stopped (SIGSTOP) and resumed, and once
all killed at the same moment and restarted. At the end every acknowledged file (close()
returned) must read back byte-exact through every node and be in S3 after `flush`; a file
whose close did not return may exist, but only with a prefix of what was written. No
node may be stuck: each answers `status` and a flush finishes.

Used by tests/integration/test_chaos.py (a short run in CI) and scripts/chaos.py (long
runs, many in a row).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache


@dataclass
class ChaosResult:
    acknowledged: int = 0
    unacknowledged: int = 0
    events: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)  # seconds until a node served again
    errors: list[str] = field(default_factory=list)

    @property
    def longest_recovery(self) -> float:
        return max(self.recoveries, default=0.0)


def _kill(m: Mount, res: ChaosResult) -> None:
    if not m.kill9():
        res.errors.append(f"{m.mnt.name}: the daemon did not die within 5 s of kill -9 "
                          "(its FUSE connection had to be aborted)")


def _restart(m: Mount) -> float:
    """Start a killed member again (same address, Raft port, cache dir); seconds until it
    is mounted."""
    t0 = time.monotonic()
    m.start(timeout=120)
    return time.monotonic() - t0


# A writer is a process of its own: a thread of the test process would leave its open
# files on the mount inherited by every process the test forks (daemon restarts), whose
# close in the child then waits on that mount's daemon.
_WRITER = """
import random, sys, time
from pathlib import Path
root, tag = Path(sys.argv[1]), sys.argv[2]
n = 0
while True:
    name = f"{tag}-{n:05d}"
    n += 1
    rng = random.Random(name)
    data = rng.randbytes(rng.choice([100, 4096, 300_000, 2 << 20]))
    print("TRY", name, flush=True)
    try:
        (root / name).write_bytes(data)
    except OSError:
        time.sleep(0.2)
        continue
    print("ACK", name, flush=True)
"""


def content(name: str) -> bytes:
    """What the writer wrote under `name` (derived from the name)."""
    rng = random.Random(name)
    return rng.randbytes(rng.choice([100, 4096, 300_000, 2 << 20]))


def _collect(proc: subprocess.Popen[str], acked: set[str], tried: set[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        what, _, name = line.strip().partition(" ")
        (acked if what == "ACK" else tried).add(name)


def run(cluster: Cluster, s3: Any, bucket: str, seconds: float, seed: int,
        nodes_n: int = 3) -> ChaosResult:
    rng = random.Random(seed)
    res = ChaosResult()
    flags = ("--writeback-delay", "2", "--txn-timeout", "5", "--catch-up-seconds", "5")
    nodes = [cluster.add(*flags) for _ in range(nodes_n)]
    cluster.wait_raft(nodes, nodes_n)
    (nodes[0].mnt / "chaos").mkdir()
    acked: set[str] = set()
    tried: set[str] = set()
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(m.mnt / "chaos"),
                                 f"n{i}w{j}"], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
               for i, m in enumerate(nodes) for j in range(2)]
    readers = [threading.Thread(target=_collect, args=(w, acked, tried), daemon=True)
               for w in writers]
    for r in readers:
        r.start()
    t_end = time.monotonic() + seconds
    all_at_once_done = False
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(1.0, 3.0))
            kind = rng.choice(["kill", "kill", "stop", "all"] if not all_at_once_done
                              else ["kill", "kill", "stop"])
            if kind == "all" or (not all_at_once_done and time.monotonic() > t_end - 8):
                all_at_once_done = True
                res.events.append("kill -9 all")
                for m in nodes:
                    _kill(m, res)
                time.sleep(rng.uniform(0.5, 2.0))
                order = nodes[:]
                rng.shuffle(order)
                threads = [threading.Thread(target=lambda m=m: res.recoveries.append(
                    _restart(m))) for m in order]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            elif kind == "kill":
                m = rng.choice(nodes)
                res.events.append(f"kill -9 {m.mnt.name}")
                _kill(m, res)
                time.sleep(rng.uniform(0.2, 2.0))
                res.recoveries.append(_restart(m))
            else:
                m = rng.choice(nodes)
                res.events.append(f"SIGSTOP {m.mnt.name}")
                assert m.proc is not None
                os.kill(m.proc.pid, signal.SIGSTOP)
                time.sleep(rng.uniform(1.0, 4.0))
                os.kill(m.proc.pid, signal.SIGCONT)
    finally:
        for w in writers:
            w.kill()  # (a write in progress is not acknowledged)
        for w in writers:
            w.wait(60)
        for r in readers:
            r.join(10)
    cluster.wait_raft(nodes, nodes_n, timeout=60)
    _check(nodes, s3, bucket, acked, tried, res)
    return res


def _check_node(m: Mount, acked: set[str], tried: set[str], errors: list[str],
                unacked: set[str]) -> None:
    """Every acknowledged file reads back byte-exact through `m`; an unacknowledged one
    (added to `unacked`) holds a prefix of what was written."""
    names = set(os.listdir(m.mnt / "chaos"))
    unacked |= names - acked
    for name in sorted(acked):
        if name not in names:
            # What else the node says of it, for the diagnosis: a lookup by name, and
            # a listing a moment later.
            time.sleep(1)
            later = name in os.listdir(m.mnt / "chaos")
            found = (m.mnt / "chaos" / name).exists()
            errors.append(f"{m.mnt.name}: acknowledged {name} is missing "
                          f"(found by name: {found}, listed 1 s later: {later})")
            continue
        try:
            got = (m.mnt / "chaos" / name).read_bytes()
        except OSError as e:
            errors.append(f"{m.mnt.name}: acknowledged {name} cannot be read: {e}")
            continue
        want = content(name)
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y),
                      min(len(got), len(want)))
            errors.append(f"{m.mnt.name}: acknowledged {name} has other bytes "
                          f"({len(got)} bytes, {len(want)} written, first "
                          f"difference at {at})")
    for name in names - acked:
        got = (m.mnt / "chaos" / name).read_bytes()
        # created (a create commits at once) but not closed: empty, as after a crash
        # of a local filesystem; a writer killed mid-write (its close is the kernel's):
        # what it wrote, a prefix; never other bytes
        if got != content(name)[:len(got)]:
            errors.append(f"{m.mnt.name}: unacknowledged {name} has other bytes "
                          f"than were written ({len(got)} bytes)")
        if name not in tried:
            errors.append(f"{m.mnt.name}: {name} was never written")


def _check(nodes: list[Mount], s3: Any, bucket: str, acked: set[str], tried: set[str],
           res: ChaosResult) -> None:
    res.acknowledged = len(acked)
    for m in nodes:
        m.status()  # answers: not stuck
    t0 = time.monotonic()
    out = objcache("flush", str(nodes[0].mnt), check=False, timeout=300)
    if out.returncode != 0:
        res.errors.append(f"flush failed after {time.monotonic() - t0:.1f}s: {out.stderr}")
    # Every node is read at once, each by a thread of its own: a node's reads are served
    # by its daemon (and the peers it fetches from), so the daemons work at the same time
    # instead of in turn (a short run acknowledges 300-700 files, up to 1.2 GB to read
    # through the three mounts). The errors are reported in node order.
    found: list[list[str]] = [[] for _ in nodes]
    unacked: list[set[str]] = [set() for _ in nodes]
    raised: list[BaseException] = []

    def check(i: int) -> None:
        try:
            _check_node(nodes[i], acked, tried, found[i], unacked[i])
        except BaseException as e:  # raised below, in the caller's thread, as before
            raised.append(e)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if raised:
        raise raised[0]
    for errors in found:
        res.errors += errors
    res.unacknowledged = len(unacked[0])
    etags: dict[str, str] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="chaos/"):
        etags |= {o["Key"][len("chaos/"):]: o["ETag"].strip('"')
                  for o in page.get("Contents", [])}
    missing = acked - etags.keys()
    if missing:
        res.errors.append(f"{len(missing)} acknowledged files not in S3 after flush, "
                          f"e.g. {sorted(missing)[:3]}")
    # Every acknowledged object's bytes: by the ETag its LIST gives (the MD5 of a single
    # PUT's body), or read back (a multipart upload's ETag is not an MD5).
    for name in sorted(acked & etags.keys()):
        want = content(name)
        if "-" in etags[name]:
            ok = s3.get_object(Bucket=bucket, Key=f"chaos/{name}")["Body"].read() == want
        else:
            ok = etags[name] == hashlib.md5(want).hexdigest()
        if not ok:
            res.errors.append(f"S3 has other bytes for acknowledged {name}")
