"""Replication while writing (objcache.backend.staging): once a close has taken a file's
staging, the file is not staged again while that close seals and replicates it. The
handle that wrote it stays open until the RELEASE that follows the close, and the stage
loop used to start a second staging from byte 0 then: the replica pulled a passthrough
checkpoint twice, once for the close and once for nothing, on the same cores."""

from __future__ import annotations

import trio
import trio.testing

from objcache.backend.staging import Stager
from objcache.cache.localfiles import LocalFile

STEP = 1 << 20


class Txn:
    replicas = 2

    def __init__(self) -> None:
        self.staged: list[tuple[str, str, int]] = []

    def stage_targets(self, key: str) -> list[str]:
        return ["b"]

    async def stage(self, node: str, sid: str, end: int) -> bool:
        self.staged.append((node, sid, end))
        return True


class Dirty:
    def __init__(self) -> None:
        self.exposed: list[str] = []

    def expose(self, sid: str, path: str) -> None:
        self.exposed.append(sid)

    def unexpose(self, sid: str) -> None:
        pass


class Local:
    """Files written through us (not bypassed): no digests to take."""

    def bypassed(self, lf: LocalFile) -> bool:
        return False


def _writing(size: int) -> tuple[Txn, Dirty, Stager, LocalFile]:
    """A stager, and a file being written through us, `size` bytes so far."""
    txn, dirty = Txn(), Dirty()
    lf = LocalFile(1, "ckpt.pt", "/nonexistent")
    lf.writers = lf.opens = 1
    lf.size = size
    lf.dirty = True
    return txn, dirty, Stager(txn, dirty, Local(), STEP), lf  # type: ignore[arg-type]


async def _poll(stager: Stager, lf: LocalFile, nursery: trio.Nursery) -> None:
    """The stage loop's look at `lf`, and whatever staging it starts, until it waits."""
    stager.poll(lf, nursery)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_file_whose_close_took_its_staging_is_not_staged_again() -> None:
    txn, dirty, stager, lf = _writing(3 * STEP)
    async with trio.open_nursery() as nursery:
        await _poll(stager, lf, nursery)
        assert txn.staged == [("b", dirty.exposed[0], 3 * STEP)]
        fin = await stager.finish(lf)  # the close
        assert fin.staged == {"b": (dirty.exposed[0], 3 * STEP)}
        stager.sweep()
        await _poll(stager, lf, nursery)  # the stage loop, while the close replicates
        assert len(dirty.exposed) == 1 and len(txn.staged) == 1
        # Written again (the same handle, after its close): that is new, and staged.
        lf.version += 1
        lf.size = 5 * STEP
        await _poll(stager, lf, nursery)
        assert len(dirty.exposed) == 2
        assert txn.staged[-1] == ("b", dirty.exposed[1], 5 * STEP)
        await stager.finish(lf)


async def test_a_closed_file_is_forgotten_once_clean() -> None:
    _, _, stager, lf = _writing(2 * STEP)
    async with trio.open_nursery() as nursery:
        await _poll(stager, lf, nursery)
        await stager.finish(lf)
        lf.dirty = False  # committed
        stager.sweep()
        assert not stager._finished
