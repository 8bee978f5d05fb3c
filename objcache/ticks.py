"""Periodic wake-ups on one grid per process.

A daemon has several loops that look at something every so often: the Raft supervisor,
the files written through a shared mapping, the flusher, the buffered object metadata, the
staging of files being written, the chunk cache's housekeeping. Each slept on its own, so
an idle daemon woke about 20 times a second, and on these VMs a wake-up costs far more CPU
than what the loops then do: a trio loop that sleeps 0.1 s at a time spends 0.43-0.50 ms
of CPU per wake-up (cold caches; a bare `time.sleep` wake-up 0.03-0.05 ms). Nine loops
like the daemon's spent 7.6 ms of CPU a second at 18 wake-ups a second; on the grid, 2.3
ms at 4.3 (`python -m benchmarks.wakeups`). An idle learner of a 32-node cluster spent
7.8-8.3 ms of CPU a second at 20-21 wake-ups; on the grid, 5.6-5.8 ms at 10 (the rest:
membership pings, which keep their own timing, and the answers to other nodes' pings).

Here a periodic loop sleeps until a point of this process's grid (`GRID` apart): the loops
that are due wake together, so the process wakes at most 1 / GRID times a second for all of
them. A period becomes a whole number of GRID steps at least as long (a 0.5 s period stays
0.5 s; the two loops that looked every 0.2 s look every 0.25 s). Waits shorter than GRID,
every bound on an operation (a timeout, a retry in the path of a request) and the
membership probes (SWIM's own timing) stay as they are.
"""

from __future__ import annotations

import math

import trio

GRID = 0.25


def next_tick(seconds: float) -> float:
    """The trio time of the first grid point at least `seconds` from now (now + `seconds`
    itself when that is shorter than GRID)."""
    at = trio.current_time() + seconds
    if seconds < GRID:
        return at
    return math.ceil(at / GRID) * GRID


async def sleep_ticks(seconds: float) -> None:
    """Sleep at least `seconds`, waking on the grid (see the module docstring)."""
    await trio.sleep_until(next_tick(seconds))
