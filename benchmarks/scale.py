"""Scale figures for docs/benchmarks.md (issue 28): N objcache daemons on 127.0.0.1, each
with its own FUSE mount and cache dir, on one SeaweedFS bucket, grown 3 -> 8 -> 16 -> 32
in one run so that the sizes are compared on the same machine at the same time.

For each N:
- join: the N-th node's start (a new process) until it is mounted (it mounts once it has
  caught up with the cluster's log); then until every node sees N members;
- idle: with nothing dirty, each daemon's CPU over a window, its RSS, and the peer
  requests each node sends per second;
- close-to-open: write + close of 1 KiB on one node, then open + read of it on another
  (two nodes that are neither the leader nor, when there are any, voters), p50 / p99;
  at rest (batches of 50, each flushed to S3 after it, outside the timing) and under
  write-back (after each round trip, the file of 5 round trips before is flushed, one at
  a time, beside them): the same load at every N either way; optionally
  (`--c2o-yield`) at rest again with the other learners in a cgroup of the idle class,
  which emulates that on a real cluster they run on CPUs of their own
  (benchmarks.idle_cgroup), or (`--c2o-frozen`) stopped;
- commits: `--writers` threads on every node but the leader, each creating 1 KiB files for
  `--seconds`; closes/s, Raft log entries and commands per close, the leader's CPU per
  close (its process, and its Raft thread), the largest apply lag seen on any member
  (entries, sampled each second) and the time the slowest member needs to apply the last
  commit once the writers stop;
- cold read: min(8, N) nodes read one 64 MiB object nobody read before, at once; the S3
  bytes all daemons fetched (one fetch per chunk for the cluster is 1.00x).
At the largest N:
- a node joins: `--moved-gib` of objects read once through node 0 (each chunk cached by
  its owner), an (N+1)-th node joins, everything is read again; the bytes the newcomer
  pulled from previous owners plus any S3 refetch, against the cluster's cached bytes;
- a node leaves (`objcache drain`), everything is read again: what moved (from S3, since
  the leaver's copies left with it);
- a voter is killed (kill -9 of the Raft leader) while a learner commits in a loop: the
  longest close, the time until commits resume and until the voter set is whole again.

Run (under the machine lock: it starts up to 33 daemons):
  flock -x /work/coord/machine.lock .venv/bin/python -m benchmarks.scale --sizes 3,8,16,32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.idle_cgroup import IdleCgroupUnavailable, idle_cgroup
from benchmarks.single_node import MiB, drop_page_cache, read_file, remove_workdir
from objcache import control
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache, stop_all
from tests.helpers.seaweed import SeaweedFS

KiB = 1 << 10
C2O_BATCH = 50  # close-to-open round trips between two flushes (see Scale.close_to_open)
WRITEBACK_LAG = 5  # under write-back, the file flushed trails the one written by this many
TICK = os.sysconf("SC_CLK_TCK")


# -- reading the daemons ----------------------------------------------------------------

def status(m: Mount) -> dict[str, Any]:
    """The node's own status, asking no other member (cheap at any N)."""
    return control.request(str(m.mnt), {"op": "status", "local": True})


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle, iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident MB (VmRSS; RssAnon: heap and anonymous maps; RssFile: mapped files)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def ms(x: float) -> float:
    return round(x * 1e3, 2)


@dataclass
class RaftView:
    leader: str | None
    voters: list[str]
    role: str
    commit: int
    applied: int
    commands: int
    thread_cpu: float


class Writers:
    """Threads that each close 1 KiB files, one after the other, in a directory of their
    own (PREFIX-MOUNT-THREAD) until stopped: the load of the commit measurements."""

    def __init__(self, nodes: list[Mount], per_node: int, prefix: str) -> None:
        self.stopped = threading.Event()
        self._counts: list[int] = []
        self._lock = threading.Lock()
        self._data = os.urandom(KiB)
        self.threads = [threading.Thread(target=self._work, args=(m.mnt / f"{prefix}-"
                                                                  f"{m.mnt.name}-{t}",))
                        for m in nodes for t in range(per_node)]

    def _work(self, d: Path) -> None:
        d.mkdir()
        i = 0
        while not self.stopped.is_set():
            (d / f"f{i}").write_bytes(self._data)
            i += 1
        with self._lock:
            self._counts.append(i)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> int:
        """Stop them; how many files they closed."""
        self.stopped.set()
        for t in self.threads:
            t.join()
        return sum(self._counts)


def raft_view(st: dict[str, Any]) -> RaftView | None:
    r = (st.get("cluster") or {}).get("raft")
    if not r:
        return None
    return RaftView(r.get("leader"), list(r.get("voters", r.get("members", []))),
                    r.get("role", ""), r.get("commit_index") or 0,
                    r.get("last_applied") or 0, r.get("commands") or 0,
                    r.get("thread_cpu_seconds") or 0.0)


# -- the run ------------------------------------------------------------------------------

@dataclass
class Scale:
    work: Path
    weed: SeaweedFS
    flags: tuple[str, ...]
    max_voters: int  # 0: every member votes (the code before issue 28)
    profile: str = ""  # a directory: py-spy the busiest idle daemon into it
    last_write: float = 0.0  # time.monotonic() when a phase last wrote files
    mounts: list[Mount] = field(default_factory=list)
    nodes: list[Mount] = field(default_factory=list)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8))

    def __post_init__(self) -> None:
        self.cluster = Cluster(self.weed.endpoint, "scale", self.work, self.mounts)

    def pid(self, m: Mount) -> int:
        assert m.proc is not None
        return m.proc.pid

    def statuses(self, nodes: Iterable[Mount] | None = None) -> list[dict[str, Any]]:
        return list(self.pool.map(status, list(nodes if nodes is not None else self.nodes)))

    def voters_wanted(self, n: int) -> int:
        return n if self.max_voters == 0 else min(n, self.max_voters)

    # joining

    def start(self, count: int, batch: int = 4) -> None:
        new = [self.cluster.add(*self.flags, start=False) for _ in range(count)]
        for i in range(0, len(new), batch):
            part = new[i:i + batch]
            ts = [threading.Thread(target=m.start, kwargs={"timeout": 120}) for m in part]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for m in part:
                if not (m.proc and m.proc.poll() is None):
                    raise RuntimeError(f"a daemon did not start: see {m.log_path}")
        self.nodes += new

    def settled(self, timeout: float = 180) -> float:
        """Until every node sees every node alive, one leader, the voter set complete and
        nothing left to apply; how long that took."""
        n = len(self.nodes)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            sts = self.statuses()
            alive = [sum(1 for m in s["cluster"]["members"]
                         if m["state"] in ("self", "alive")) for s in sts]
            views = [raft_view(s) for s in sts]
            leaders = {v.leader for v in views if v is not None}
            ok = (all(a == n for a in alive) and all(v is not None for v in views)
                  and len(leaders) == 1 and None not in leaders
                  and all(len(v.voters) == self.voters_wanted(n) for v in views if v)
                  and all(v.applied >= v.commit for v in views if v))
            if ok:
                return time.perf_counter() - t0
            last = (alive, [(v.role, len(v.voters), v.leader) if v else None for v in views])
            time.sleep(0.5)
        raise RuntimeError(f"the cluster of {n} did not settle in {timeout:.0f}s: {last}")

    def grow_to(self, n: int) -> dict[str, Any]:
        if len(self.nodes) < n - 1:
            self.start(n - 1 - len(self.nodes))
            self.settled()
        m = self.cluster.add(*self.flags, start=False)
        t0 = time.perf_counter()
        m.start(timeout=120)
        join_s = time.perf_counter() - t0
        self.nodes.append(m)
        settle_s = self.settled()
        return {"nth_join_mount_s": round(join_s, 2),
                "all_see_n_s": round(join_s + settle_s, 2)}

    # roles

    def leader(self) -> Mount:
        for m, st in zip(self.nodes, self.statuses(), strict=True):
            v = raft_view(st)
            if v is not None and v.role == "leader":
                return m
        raise RuntimeError("no leader")

    def non_voters(self) -> list[Mount]:
        """Nodes that do not vote, or (all voting) nodes that do not lead."""
        sts = self.statuses()
        views = [raft_view(s) for s in sts]
        voters = set(views[0].voters) if views[0] else set()
        out = [m for m, s in zip(self.nodes, sts, strict=True)
               if (s["cluster"]["raft"] or {}).get("self") not in voters]
        if len(out) >= 2:
            return out
        return [m for m, v in zip(self.nodes, views, strict=True) if v and v.role != "leader"]

    # measurements

    def wait_clean(self, timeout: float = 120) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(s["dirty"]["files"] == 0 for s in self.statuses()):
                return time.perf_counter() - t0
            time.sleep(1)
        return -1.0

    def idle(self, seconds: float) -> dict[str, Any]:
        clean_s = self.wait_clean()
        # A file written through passthrough is watched (stat'ed every 0.2 s) for 60 s
        # after its close (LocalFiles.BYPASS_WATCH): at rest means after that too.
        time.sleep(max(3.0, self.last_write + 65 - time.monotonic()))
        pids = [self.pid(m) for m in self.nodes]
        dogs = [c for p in pids for c in children(p)]
        sent0 = [s["cluster"]["peer_requests_sent"] for s in self.statuses()]
        c0 = [cpu_seconds(p) for p in pids]
        d0 = [cpu_seconds(p) for p in dogs]
        t0 = time.perf_counter()
        time.sleep(seconds)
        c1 = [cpu_seconds(p) for p in pids]
        d1 = [cpu_seconds(p) for p in dogs]
        dt = time.perf_counter() - t0
        sent1 = [s["cluster"]["peer_requests_sent"] for s in self.statuses()]
        cpu = [(b - a) / dt for a, b in zip(c0, c1, strict=True)]
        rss = [rss_mb(p) for p in pids]
        roles = [(raft_view(s) or RaftView(None, [], "?", 0, 0, 0, 0.0)).role
                 for s in self.statuses()]
        by_role: dict[str, list[float]] = {}
        for role, c, r in zip(roles, cpu, rss, strict=True):
            by_role.setdefault(role, []).append(c)
            by_role.setdefault(role + "_rss", []).append(r)
        per_node_req = [(b - a) / dt for a, b in zip(sent0, sent1, strict=True)]
        dogs_cpu = sum(b - a for a, b in zip(d0, d1, strict=True)) / dt
        if self.profile:
            busiest = pids[cpu.index(max(cpu))]
            out = Path(self.profile) / f"idle-{len(pids)}-{busiest}.txt"
            subprocess.run(["py-spy", "record", "-p", str(busiest), "-d", "10", "-r", "200",
                            "-f", "raw", "-o", str(out), "--threads"], capture_output=True)
        return {"wait_clean_s": round(clean_s, 1),
                "idle_cpu_all_daemons_cores": round(sum(cpu), 3),
                "idle_cpu_max_daemon_cores": round(max(cpu), 4),
                "idle_cpu_watchdogs_cores": round(dogs_cpu, 4),
                "rss_max_mb": round(max(rss), 1),
                "rss_max_anon_file_mb": [round(rss_mb(pids[rss.index(max(rss))], f), 1)
                                         for f in ("RssAnon", "RssFile")],
                "rss_median_mb": round(statistics.median(rss), 1),
                "peer_requests_per_node_s": round(statistics.mean(per_node_req), 2),
                "by_role": {k: round(max(v), 4) for k, v in by_role.items()}}

    def close_to_open(self, a: Mount, b: Mount, files: int, tag: str,
                      under_writeback: bool = False, leader: Mount | None = None
                      ) -> dict[str, Any]:
        """`files` round trips in batches of C2O_BATCH, each batch in a directory of its
        own. At rest (the default): each batch's files are flushed to S3 after it, outside
        the timing, so no batch meets write-back at any N. (In one stream of 200, the
        uploads of the first files ran during the last round trips at 16 and 32 nodes,
        where a round trip is slower, and never at 3: the sizes were compared under
        different loads.) `under_writeback`: the same load at every N instead, one upload
        per round trip: after each round trip, the file written WRITEBACK_LAG round trips
        before is queued for a flush, one file at a time, beside the round trips.
        `leader`: the node whose status counts the log entries (found anew for each batch
        when not given: the stopped learners of `close_to_open_frozen` cannot answer the
        search)."""
        d = f"c2o-{tag}"
        (a.mnt / d).mkdir()
        os.listdir(b.mnt / d)
        data = os.urandom(KiB)
        wc, c2o = [], []
        # (what the round trips cost the whole cluster: on 2 cores, every daemon applying
        # every entry can make the round trip wait for CPU, not for the network)
        pids = [self.pid(m) for m in self.mounts if m.proc is not None]
        cpu, busy, wall, entries, commands = 0.0, 0.0, 0.0, 0, 0
        batches = [list(range(i, min(files, i + C2O_BATCH)))
                   for i in range(0, files, C2O_BATCH)]
        uploads = ThreadPoolExecutor(1)  # one flush at a time, in the order asked
        written: list[Path] = []
        flushes: list[Future[None]] = []
        for k, batch in enumerate(batches):
            sub = a.mnt / d / f"b{k}"
            sub.mkdir()
            os.listdir(b.mnt / d / f"b{k}")
            lead = leader or self.leader()
            v0 = raft_view(status(lead))
            cpu0, busy0, t0_all = (sum(cpu_seconds(p) for p in pids), machine_busy(),
                                   time.monotonic())
            for i in batch:
                t0 = time.perf_counter()
                (sub / f"f{i}").write_bytes(data)
                t1 = time.perf_counter()
                with open(b.mnt / d / f"b{k}" / f"f{i}", "rb") as f:
                    got = f.read()
                t2 = time.perf_counter()
                if got != data:
                    raise AssertionError(f"close-to-open broken: {b.mnt / d / f'b{k}/f{i}'} "
                                         f"read {len(got)} bytes")
                wc.append(t1 - t0)
                c2o.append(t2 - t1)
                written.append(sub / f"f{i}")
                if under_writeback and len(written) > WRITEBACK_LAG:
                    flushes.append(uploads.submit(flush, written[-WRITEBACK_LAG - 1]))
            wall += time.monotonic() - t0_all
            cpu += sum(cpu_seconds(p) for p in pids) - cpu0
            busy += machine_busy() - busy0
            v1 = raft_view(status(lead))
            if v0 is not None and v1 is not None:  # (None: the leader changed meanwhile)
                entries += v1.commit - v0.commit
                commands += v1.commands - v0.commands
            if not under_writeback:
                flush(sub)
        uploads.shutdown()
        for f in flushes:
            f.result()  # (a flush that failed fails the run)
        flush(a.mnt / d)
        self.last_write = time.monotonic()
        # (every entry is applied by every member; a learner also gets each one in an answer
        # to its feed request)
        per_trip = [round(entries / files, 2), round(commands / files, 2)]
        return {"write_close_ms": {"p50": ms(statistics.median(wc)), "p99": ms(pct(wc, 99))},
                "close_to_open_ms": {"p50": ms(statistics.median(c2o)),
                                     "p99": ms(pct(c2o, 99)), "max": ms(max(c2o))},
                "round_trip_cost": {"log_entries_commands": per_trip,
                                    "daemons_cpu_ms_per_round_trip": ms(cpu / files),
                                    "daemons_cores": round(cpu / wall, 2),
                                    "machine_busy_cores": round(busy / wall, 2)}}

    def close_to_open_frozen(self, a: Mount, b: Mount, files: int, tag: str
                             ) -> dict[str, Any]:
        """The same round trips with every other learner stopped (SIGSTOP, for a few
        seconds: less than membership takes to call them dead): what is left of the
        latency once the cluster's other daemons no longer compete for the CPU."""
        voters = set(self.voter_addrs())
        leader = self.leader()
        others = [m for m in self.nodes if m is not a and m is not b
                  and raft_addr(m) not in voters and m.proc is not None]
        for m in others:
            os.kill(self.pid(m), signal.SIGSTOP)
        try:
            r = self.close_to_open(a, b, files, f"{tag}-frozen", leader=leader)
        finally:
            for m in others:
                os.kill(self.pid(m), signal.SIGCONT)
        r["stopped"] = len(others)
        return r

    def close_to_open_yielding(self, a: Mount, b: Mount, files: int, tag: str
                               ) -> dict[str, Any]:
        """The same round trips with every other learner in a cgroup of the idle class
        (benchmarks.idle_cgroup): they keep following the log, holding copies and
        answering, on the CPU the round trip's daemons leave, as they would on nodes of
        their own. Unlike `close_to_open_frozen`, nothing is routed around them."""
        voters = set(self.voter_addrs())
        others = [self.pid(m) for m in self.nodes if m is not a and m is not b
                  and raft_addr(m) not in voters and m.proc is not None]
        try:
            with idle_cgroup(others):
                r = self.close_to_open(a, b, files, f"{tag}-yield")
        except IdleCgroupUnavailable as e:
            return {"unavailable": str(e)}
        r["yielding"] = len(others)
        return r

    def voter_addrs(self) -> list[str]:
        views = [raft_view(s) for s in self.statuses()]
        return sorted(views[0].voters) if views and views[0] else []

    def commits(self, writers: int, seconds: float, tag: str) -> dict[str, Any]:
        lead = self.leader()
        lpid = self.pid(lead)
        nodes = [m for m in self.nodes if m is not lead]
        writing = Writers(nodes, writers, f"tp-{tag}")
        stop = writing.stopped

        lags: list[int] = []

        def sample() -> None:
            while not stop.wait(1.0):
                sts = self.statuses()
                views = [raft_view(s) for s in sts]
                top = max(v.commit for v in views if v)
                lags.append(max(top - v.applied for v in views if v))

        v0 = raft_view(status(lead))
        assert v0 is not None
        # every daemon's CPU too, by role: what a commit costs a voter that feeds learners
        # and a member that only applies (the paper model's per-member cost)
        roles = [(raft_view(s) or RaftView(None, [], "?", 0, 0, 0, 0.0)).role
                 for s in self.statuses(nodes)]
        npids = [self.pid(m) for m in nodes]
        all0 = [cpu_seconds(p) for p in npids]
        cpu0, raft0 = cpu_seconds(lpid), v0.thread_cpu
        sampler = threading.Thread(target=sample)
        t0 = time.perf_counter()
        writing.start()
        sampler.start()
        time.sleep(seconds)
        closes = writing.stop()
        elapsed = time.perf_counter() - t0
        self.last_write = time.monotonic()
        cpu1 = cpu_seconds(lpid)
        all1 = [cpu_seconds(p) for p in npids]
        v1 = raft_view(status(lead))
        assert v1 is not None
        raft1 = v1.thread_cpu
        sampler.join()
        # the slowest member applying the last commit
        t1 = time.perf_counter()
        catch_up = -1.0
        while time.perf_counter() - t1 < 60:
            views = [raft_view(s) for s in self.statuses()]
            if all(v is not None and v.applied >= v1.commit for v in views):
                catch_up = time.perf_counter() - t1
                break
            time.sleep(0.02)
        per_role: dict[str, list[float]] = {}
        for role, a, b in zip(roles, all0, all1, strict=True):
            per_role.setdefault(role, []).append((b - a) * 1e3 / max(1, closes))
        entries = v1.commit - v0.commit
        cmds = v1.commands - v0.commands
        return {"writers": len(writing.threads), "closes": closes,
                "closes_per_s": round(closes / elapsed, 1),
                "log_entries_per_close": round(entries / max(1, closes), 3),
                "commands_per_close": round(cmds / max(1, closes), 3) if cmds else None,
                "leader_cpu_ms_per_close": round((cpu1 - cpu0) * 1e3 / max(1, closes), 3),
                "leader_raft_thread_ms_per_close": round((raft1 - raft0) * 1e3 / max(1, closes),
                                                         3),
                "leader_cpu_cores": round((cpu1 - cpu0) / elapsed, 2),
                # (these members write too: 1/(N-1) of the closes each, and apply all)
                "member_cpu_ms_per_close_median": {
                    k: round(statistics.median(v), 3) for k, v in per_role.items()},
                "all_daemons_cpu_ms_per_close": round(
                    (sum(all1) - sum(all0) + cpu1 - cpu0) * 1e3 / max(1, closes), 3),
                "apply_lag_max_entries": max(lags, default=0),
                "slowest_member_catch_up_ms": ms(catch_up) if catch_up >= 0 else None}

    def cold_read(self, key: str) -> dict[str, Any]:
        readers = self.nodes[:8]
        before = sum(s["cache"]["bytes_read_from_s3"] for s in self.statuses())
        size = os.path.getsize(readers[0].mnt / key)
        t0 = time.perf_counter()
        list(self.pool.map(lambda m: read_file(m.mnt / key), readers))
        elapsed = time.perf_counter() - t0
        after = sum(s["cache"]["bytes_read_from_s3"] for s in self.statuses())
        return {"readers": len(readers), "s3_bytes_over_size": round((after - before) / size, 3),
                "seconds": round(elapsed, 2)}

    def read_all(self, m: Mount, keys: list[str]) -> None:
        drop_page_cache()
        for k in keys:
            read_file(m.mnt / k)

    def moved(self, keys: list[str]) -> dict[str, Any]:
        reader = self.nodes[0]
        self.read_all(reader, keys)  # cold: every chunk fetched once, by its owner
        sts = self.statuses()
        cached = sum(s["cache"]["chunk_bytes"] for s in sts)
        s3_0 = sum(s["cache"]["bytes_read_from_s3"] for s in sts)
        n = len(self.nodes)
        # the (N+1)-th node joins
        m = self.cluster.add(*self.flags, start=False)
        t0 = time.perf_counter()
        m.start(timeout=120)
        join_s = time.perf_counter() - t0
        self.nodes.append(m)
        self.settled()
        share = next(r["ring_share"] for r in status(m)["cluster"]["members"]
                     if r["state"] == "self")
        self.read_all(reader, keys)
        sts = self.statuses()
        new = status(m)["cache"]
        moved_join = new["bytes_fetched_from_peers"] + sum(
            s["cache"]["bytes_read_from_s3"] for s in sts) - s3_0
        # a node leaves (not the reader, not the newcomer)
        leaver = self.nodes[n // 2]
        # (the baseline counts the nodes that stay: the leaver's own counters leave with
        # it, and counting them made the figure negative once, by a chunk it had fetched)
        gone = status(leaver)["pid"]
        s3_1 = sum(s["cache"]["bytes_read_from_s3"] for s in sts if s["pid"] != gone)
        fetched_1 = sum(s["cache"]["bytes_fetched_from_peers"] for s in sts
                        if s["pid"] not in (status(reader)["pid"], gone))
        t0 = time.perf_counter()
        objcache("drain", str(leaver.mnt), timeout=300)
        leaver.wait_exit(120)
        drain_s = time.perf_counter() - t0
        self.nodes.remove(leaver)
        self.settled()
        self.read_all(reader, keys)
        sts = self.statuses()
        rpid = status(reader)["pid"]
        moved_leave = (sum(s["cache"]["bytes_read_from_s3"] for s in sts) - s3_1
                       + sum(s["cache"]["bytes_fetched_from_peers"] for s in sts
                             if s["pid"] != rpid) - fetched_1)
        return {"cached_bytes": cached, "join_nodes_after": n + 1,
                "newcomer_ring_share": share,
                "moved_on_join_bytes": moved_join,
                "moved_on_join_over_cached": round(moved_join / cached, 4),
                "limit_1_5_over_n": round(1.5 / (n + 1), 4),
                "join_s": round(join_s, 2), "drain_s": round(drain_s, 2),
                "moved_on_leave_bytes": moved_leave,
                "moved_on_leave_over_cached": round(moved_leave / cached, 4)}

    def voter_kill(self, txn_timeout: float) -> dict[str, Any]:
        lead = self.leader()
        writer = self.non_voters()[-1]
        d = writer.mnt / "kill"
        d.mkdir()
        times: list[tuple[float, float, bool]] = []
        stop = threading.Event()

        def loop() -> None:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    (d / f"f{i}").write_bytes(b"k" * 100)
                    ok = True
                except OSError:
                    ok = False
                times.append((t0, time.monotonic(), ok))
                i += 1
                time.sleep(0.01)

        t = threading.Thread(target=loop)
        t.start()
        time.sleep(2)
        killed_at = time.monotonic()
        lead.kill9()
        self.nodes.remove(lead)
        dead = raft_addr(lead)
        promoted = -1.0
        deadline = killed_at + 60
        while time.monotonic() < deadline:
            views = [raft_view(s) for s in self.statuses()]
            led = all(v is not None and v.leader and v.leader != dead for v in views)
            whole = all(v is not None and dead not in v.voters
                        and len(v.voters) == self.voters_wanted(len(self.nodes))
                        for v in views)
            if led and (whole or not self.max_voters):
                promoted = time.monotonic() - killed_at
                break
            time.sleep(0.3)
        time.sleep(2)
        stop.set()
        t.join()
        after = [(s, e, ok) for s, e, ok in times if e > killed_at]
        resumed = next((e - killed_at for s, e, ok in after if ok and s > killed_at), None)
        failed = sum(1 for _, _, ok in after if not ok)
        return {"killed": "leader", "longest_close_s": round(max(e - s for s, e, _ in after), 2),
                "commits_resumed_after_s": None if resumed is None else round(resumed, 2),
                "failed_closes": failed, "txn_timeout_s": txn_timeout,
                "voter_set_whole_after_s": round(promoted, 2) if promoted >= 0 else None}


def flush(path: Path) -> None:
    """`objcache flush PATH`: every file under it in S3 (through the control socket, not
    a new interpreter: the harness should not add a process start to what it times)."""
    control.request(str(path), {"op": "flush", "ino": os.lstat(path).st_ino})


def raft_addr(m: Mount) -> str:
    flags = list(m.extra)
    return f"127.0.0.1:{flags[flags.index('--raft-port') + 1]}"


def phase(name: str, f: Callable[..., Any], *args: Any) -> Any:
    t0 = time.perf_counter()
    r = f(*args)
    print(f"   {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    return r


def upload(s3: Any, work: Path, key: str, size: int) -> None:
    src = work / "upload.src"
    with open(src, "wb") as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            f.write(os.urandom(n))
            left -= n
    s3.upload_file(str(src), "scale", key)
    src.unlink()


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="objcache-scale-", dir=args.workdir))
    weed = SeaweedFS(work)
    weed.start()
    flags = ("--cache-size", "4G", "--chunk-size", args.chunk_size, "--log-level", "info",
             *args.flag)
    sc = Scale(work, weed, flags, args.voters, profile=args.profile)
    out: dict[str, Any] = {"sizes": {}, "flags": list(flags)}
    sizes = [int(x) for x in args.sizes.split(",")]
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket="scale")
        for n in sizes:
            upload(s3, work, f"cold64-{n}", 64 * MiB)
        moved_keys = [f"moved/{i}" for i in range(args.moved_gib * 4)]
        for k in moved_keys:
            upload(s3, work, k, 256 * MiB)
        for n in sizes:
            step = f"N={n}"
            print(f"-- {step}", flush=True)
            r: dict[str, Any] = phase("join", sc.grow_to, n)
            r["idle"] = phase("idle", sc.idle, args.idle_seconds)
            a, b = sc.non_voters()[-2:]
            r.update(phase("close-to-open", sc.close_to_open, a, b, args.files, str(n)))
            r["under_writeback"] = phase("close-to-open under write-back", sc.close_to_open,
                                         a, b, args.files, f"{n}w", True)
            if args.c2o_frozen:
                r["frozen"] = phase("close-to-open, the other learners stopped",
                                    sc.close_to_open_frozen, a, b, args.c2o_frozen, str(n))
            if args.c2o_yield:
                r["yielding"] = phase("close-to-open, the other learners in an idle cgroup",
                                      sc.close_to_open_yielding, a, b, args.c2o_yield,
                                      str(n))
            r["commits"] = phase("commits", sc.commits, args.writers, args.seconds, str(n))
            r["cold_read_64mib"] = phase("cold read", sc.cold_read, f"cold64-{n}")
            r["s3_errors_all_nodes"] = sum(sum(st["s3"]["errors"].values())
                                           for st in sc.statuses())
            out["sizes"][step] = r
            print(json.dumps(r), flush=True)
        if args.moved_gib:
            out["moved"] = sc.moved(moved_keys)
            print(json.dumps(out["moved"]), flush=True)
        if args.kill:
            out["voter_kill"] = sc.voter_kill(10.0)
            print(json.dumps(out["voter_kill"]), flush=True)
        out["errors_in_logs"] = {m.mnt.name: m.errors_in_log()[:5] for m in sc.mounts
                                 if m.errors_in_log()}
    finally:
        stop_all(sc.mounts, grace=5)
        weed.stop()
        if not args.keep:
            remove_workdir(work)
    return out


def table(out: dict[str, Any]) -> str:
    sizes = list(out["sizes"])
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("N-th node joins and mounts (s)", lambda r: r["nth_join_mount_s"]),
        ("every node sees N members (s)", lambda r: r["all_see_n_s"]),
        ("write + close 1 KiB p50 / p99 (ms)",
         lambda r: f"{r['write_close_ms']['p50']} / {r['write_close_ms']['p99']}"),
        ("close-to-open p50 / p99 (ms)",
         lambda r: f"{r['close_to_open_ms']['p50']} / {r['close_to_open_ms']['p99']}"),
        ("close-to-open under write-back: p50 / p99 (ms); write + close p50",
         lambda r: (f"{r['under_writeback']['close_to_open_ms']['p50']} / "
                    f"{r['under_writeback']['close_to_open_ms']['p99']}; "
                    f"{r['under_writeback']['write_close_ms']['p50']}"
                    if r.get("under_writeback") else "-")),
        ("close-to-open under write-back: CPU per round trip (ms); log entries",
         lambda r: (f"{r['under_writeback']['round_trip_cost']['daemons_cpu_ms_per_round_trip']}"
                    f"; {r['under_writeback']['round_trip_cost']['log_entries_commands'][0]}"
                    if r.get("under_writeback") else "-")),
        ("close-to-open p50 / p99, the other learners stopped (ms)",
         lambda r: (f"{r['frozen']['close_to_open_ms']['p50']} / "
                    f"{r['frozen']['close_to_open_ms']['p99']} ({r['frozen']['stopped']})"
                    if r.get("frozen") else "-")),
        ("close-to-open p50 / p99, the other learners in an idle cgroup (ms)",
         lambda r: (f"{r['yielding']['close_to_open_ms']['p50']} / "
                    f"{r['yielding']['close_to_open_ms']['p99']} ({r['yielding']['yielding']})"
                    if r.get("yielding", {}).get("close_to_open_ms") else "-")),
        ("close-to-open: all daemons' CPU per round trip (ms); machine busy (cores)",
         lambda r: f"{r['round_trip_cost']['daemons_cpu_ms_per_round_trip']}; "
                   f"{r['round_trip_cost']['machine_busy_cores']}"),
        ("close-to-open: log entries / commands per round trip",
         lambda r: " / ".join(str(x) for x in
                              r["round_trip_cost"].get("log_entries_commands") or ["-"])),
        ("closes/s (writers)", lambda r: f"{r['commits']['closes_per_s']} "
                                         f"({r['commits']['writers']})"),
        ("log entries / commands per close",
         lambda r: f"{r['commits']['log_entries_per_close']} / "
                   f"{r['commits']['commands_per_close']}"),
        ("leader CPU per close (ms): process / Raft thread",
         lambda r: f"{r['commits']['leader_cpu_ms_per_close']} / "
                   f"{r['commits']['leader_raft_thread_ms_per_close']}"),
        ("CPU per close (ms): follower voter / learner, median; all daemons",
         lambda r: f"{r['commits']['member_cpu_ms_per_close_median'].get('follower', '-')} / "
                   f"{r['commits']['member_cpu_ms_per_close_median'].get('learner', '-')}; "
                   f"{r['commits']['all_daemons_cpu_ms_per_close']}"),
        ("apply lag, slowest member: max entries / catch-up (ms)",
         lambda r: f"{r['commits']['apply_lag_max_entries']} / "
                   f"{r['commits']['slowest_member_catch_up_ms']}"),
        ("idle CPU, all daemons (cores)", lambda r: r["idle"]["idle_cpu_all_daemons_cores"]),
        ("idle CPU, busiest daemon (cores)", lambda r: r["idle"]["idle_cpu_max_daemon_cores"]),
        ("peer requests per node per s, idle",
         lambda r: r["idle"]["peer_requests_per_node_s"]),
        ("RSS max / median (MB)",
         lambda r: f"{r['idle']['rss_max_mb']} / {r['idle']['rss_median_mb']}"),
        ("S3 bytes / size, 64 MiB read cold on min(8,N) nodes",
         lambda r: r["cold_read_64mib"]["s3_bytes_over_size"]),
    ]
    lines = ["| | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name, f in rows:
        lines.append(f"| {name} | " + " | ".join(str(f(out["sizes"][s])) for s in sizes) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3,8,16,32")
    p.add_argument("--voters", type=int, default=5,
                   help="the most voters the cluster keeps (0: every member votes)")
    p.add_argument("--files", type=int, default=50, help="close-to-open round trips")
    p.add_argument("--c2o-frozen", type=int, default=0, metavar="FILES",
                   help="also that many round trips with the other learners stopped")
    p.add_argument("--c2o-yield", type=int, default=0, metavar="FILES",
                   help="also that many round trips with the other learners in a cgroup "
                        "of the idle class (each node's own CPU, emulated)")
    p.add_argument("--writers", type=int, default=2, help="writer threads per node")
    p.add_argument("--seconds", type=float, default=8.0, help="commit phase length")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--chunk-size", default="8M")
    p.add_argument("--moved-gib", type=int, default=4,
                   help="data cached before the join/leave measurement (0: skip it)")
    p.add_argument("--kill", action="store_true", help="kill the leader at the end")
    p.add_argument("--flag", action="append", default=[], help="extra daemon flag")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--profile", default="", help="py-spy the busiest idle daemon into DIR")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    out = run(args)
    print(json.dumps(out, indent=2))
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
