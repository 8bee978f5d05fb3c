"""Does a background process's scheduling class keep it out of a latency-bound chain's
way? Three processes pass a byte around through pipes (1 ms of CPU per hop) while 29
background processes each wake every 20-60 ms for 1 ms of CPU, on however many cores the
machine has; the chain's round trip p50 / p99, for:

- background at normal priority;
- background SCHED_IDLE (per process), all in this one session;
- the same, each process in a session of its own, as `objcache mount` and the test and
  benchmark harnesses start daemons: with the kernel's autogroups each session is a task
  group of its own, and the policy no longer shields the chain;
- each in a session of its own, the background in a cgroup of the idle class
  (benchmarks.idle_cgroup): shielded again.

    python -m benchmarks.sched_chain [--trips 600]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.idle_cgroup import IdleCgroupUnavailable, idle_cgroup

BACKGROUND = 29
HOPS = 3


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def hop(rfd: int, wfd: int) -> None:
    while os.read(rfd, 1):
        spin(1.0)
        os.write(wfd, b"x")


def background(policy: str) -> None:
    if policy == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        time.sleep(random.uniform(0.02, 0.06))
        spin(1.0)


def chain(trips: int, policy: str, sessions: bool, cgroup: bool) -> tuple[float, float]:
    me = [sys.executable, "-m", "benchmarks.sched_chain"]
    bgs = [subprocess.Popen([*me, "--background", policy], start_new_session=sessions)
           for _ in range(BACKGROUND)]
    pipes = [os.pipe() for _ in range(HOPS + 1)]
    hops = [subprocess.Popen([*me, "--hop", str(pipes[i][0]), str(pipes[i + 1][1])],
                             pass_fds=(pipes[i][0], pipes[i + 1][1]),
                             start_new_session=sessions) for i in range(HOPS)]
    try:
        def run() -> tuple[float, float]:
            time.sleep(1.0)
            lat = []
            for _ in range(trips):
                t = time.perf_counter()
                os.write(pipes[0][1], b"x")
                os.read(pipes[HOPS][0], 1)
                lat.append(time.perf_counter() - t)
                time.sleep(0.01)
            lat.sort()
            return lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3

        if cgroup:
            with idle_cgroup(p.pid for p in bgs):
                return run()
        return run()
    finally:
        for p in bgs + hops:
            p.kill()
            p.wait()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=600)
    ap.add_argument("--background", help=argparse.SUPPRESS)
    ap.add_argument("--hop", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.background:
        background(args.background)
        return
    if args.hop:
        hop(*args.hop)
        return
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print(f"cores {os.cpu_count()}, sched_autogroup_enabled "
          f"{autogroup.read_text().strip() if autogroup.exists() else 'absent'}")
    variants = [("background normal, one session", "normal", False, False),
                ("background SCHED_IDLE, one session", "idle", False, False),
                ("background normal, a session each", "normal", True, False),
                ("background SCHED_IDLE, a session each", "idle", True, False),
                ("background in an idle cgroup, a session each", "normal", True, True)]
    print("| variant | p50 (ms) | p99 (ms) |\n|---|---|---|")
    for name, policy, sessions, cgroup in variants:
        try:
            p50, p99 = chain(args.trips, policy, sessions, cgroup)
        except IdleCgroupUnavailable as e:
            print(f"| {name} | - | - ({e}) |")
            continue
        print(f"| {name} | {p50:.2f} | {p99:.2f} |", flush=True)


if __name__ == "__main__":
    main()
