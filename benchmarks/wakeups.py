"""What a wake-up costs on this machine, and what waking periodic loops together saves
(objcache.ticks): the figures behind the grid of objcache's periodic loops.

In one process, alternating, for `--seconds` each round:
- a bare `time.sleep(0.01)` loop and a trio `sleep(d)` loop for d = 0.001, 0.01 and 0.1 s:
  the CPU of one wake-up (the process's own run time, /proc/self/schedstat);
- the nine periodic loops of an idle daemon, each doing a little work: as they were before
  the grid ("free": periods 0.2, 0.2, 0.5, 0.5, 1, 1, 1, 1 and 5 s, each sleeping on its
  own), and as they are ("grid": the two 0.2 s ones now 0.25 s, all on the grid): CPU per
  second, and wake-ups per second of the process.

    python -m benchmarks.wakeups [--seconds 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import trio

from objcache.ticks import sleep_ticks

BEFORE = (0.2, 0.2, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 5.0)
NOW = (0.25, 0.25, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 5.0)  # (SUPERVISE_POLL, BYPASS_LOOK: 0.25)


def run_ns() -> int:
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[0])


def wakeups() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def bare_sleep(seconds: float) -> float:
    """Microseconds of CPU per `time.sleep(0.01)` wake-up."""
    n = max(1, int(seconds / 0.01))
    a = run_ns()
    for _ in range(n):
        time.sleep(0.01)
    return (run_ns() - a) / n / 1e3


async def trio_sleep(d: float, seconds: float) -> float:
    """Microseconds of CPU per trio `sleep(d)` wake-up."""
    n = max(10, int(seconds / d))
    a = run_ns()
    for _ in range(n):
        await trio.sleep(d)
    return (run_ns() - a) / n / 1e3


async def loops(grid: bool, seconds: float) -> tuple[float, float]:
    """(ms of CPU per second, wake-ups per second) of the nine loops."""

    async def one(period: float) -> None:
        await trio.sleep(random.random() * period)
        while True:
            if grid:
                await sleep_ticks(period)
            else:
                await trio.sleep(period)
            sorted((str(i), i) for i in range(32))  # a supervisor's look at 32 members

    async with trio.open_nursery() as nursery:
        for p in NOW if grid else BEFORE:
            nursery.start_soon(one, p)
        await trio.sleep(1.0)
        a, w = run_ns(), wakeups()
        await trio.sleep(seconds)
        cpu, woke = run_ns() - a, wakeups() - w
        nursery.cancel_scope.cancel()
    return cpu / seconds / 1e6, woke / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        got.setdefault("time.sleep(0.01), us per wake-up", []).append(bare_sleep(2.0))
        for d in (0.001, 0.01, 0.1):
            got.setdefault(f"trio sleep({d}), us per wake-up", []).append(
                trio.run(trio_sleep, d, 2.0))
        for grid in (False, True):
            cpu, woke = trio.run(loops, grid, args.seconds)
            name = "grid" if grid else "free"
            got.setdefault(f"nine loops, {name}: ms of CPU per s", []).append(cpu)
            got.setdefault(f"nine loops, {name}: wake-ups per s", []).append(woke)
    print("| figure | rounds | median |\n|---|---|---|")
    for name, vals in got.items():
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in vals)} | "
              f"{statistics.median(vals):.1f} |")


if __name__ == "__main__":
    main()
