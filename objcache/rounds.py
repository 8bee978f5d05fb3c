"""Shared rounds of some work: the callers that arrive while a round runs share the next one,
so each caller is answered by a round that started after it arrived. Read barriers use it
twice: a node's barrier (objcache.txn.coordinator) and a leader's confirmation of its term
for read indexes (objcache.cluster.readindex)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import trio

R = TypeVar("R")


class SharedRounds(Generic[R]):
    def __init__(self) -> None:
        self._started = 0
        self._done = 0
        self._running = False
        self._finished = trio.Event()
        self._result: R | None = None

    async def join(self, run: Callable[[], Awaitable[R]]) -> R | None:
        """The result of a round of `run` that started after this call: one this caller
        ran, or one another caller ran meanwhile. A round that raised gives the others
        None (its exception goes to the caller that ran it)."""
        want = self._started + 1
        while self._done < want:
            if self._running:
                await self._finished.wait()
                continue
            self._running = True
            self._started += 1
            n = self._started
            self._result = None
            try:
                self._result = await run()
            finally:
                self._done = max(self._done, n)
                self._running = False
                self._finished.set()
                self._finished = trio.Event()
        return self._result
