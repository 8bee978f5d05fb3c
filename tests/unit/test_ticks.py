"""Periodic loops wake together on the process's grid (objcache.ticks)."""

from __future__ import annotations

import random
from typing import Any

import trio

from objcache.ticks import GRID, sleep_ticks


async def test_periodic_loops_wake_together_on_the_grid(autojump_clock: Any) -> None:
    woke: list[tuple[float, float, float]] = []  # (period, asleep since, woke)

    end = trio.current_time() + 20

    async def loop(period: float) -> None:
        await trio.sleep(random.uniform(0, 1))  # loops start at any time
        while trio.current_time() < end:
            t0 = trio.current_time()
            await sleep_ticks(period)
            woke.append((period, t0, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for period in (0.25, 0.25, 0.5, 1.0, 1.0, 5.0):
            nursery.start_soon(loop, period)
    assert all(t1 - t0 >= period for period, t0, t1 in woke)  # never shorter than asked
    assert all(t1 - t0 < period + GRID for period, t0, t1 in woke)
    instants = {round(t1 / GRID, 6) for _, _, t1 in woke}
    assert all(i == int(i) for i in instants)  # on the grid
    # together: the process woke at most once per grid step, for 95 wake-ups or more
    assert len(woke) >= 95 and len(instants) <= 21 / GRID + 1


async def test_a_wait_shorter_than_the_grid_stays_as_asked(autojump_clock: Any) -> None:
    await trio.sleep(0.013)
    t0 = trio.current_time()
    await sleep_ticks(0.1)
    assert abs(trio.current_time() - t0 - 0.1) < 1e-9
