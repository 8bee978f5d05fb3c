"""Replication while writing, for the cluster backend.

A closed file must be on `--replicas` nodes when close() returns. Instead of copying the
whole file at close, the writer exposes its working copy under a stage id, and each time a
chunk is complete the likely replicas pull the new bytes (objcache.txn.dirtystore stages).
close() then has them adopt the staged prefix and pull only the rest.

Staged bytes are sealed (LocalFile.sealed): a write or truncate below the seal breaks it,
and the close falls back to a whole pull. A file the kernel writes without us (passthrough)
cannot show us such a write: each staged range's digest is taken before the replicas pull
it, and the close uses the stage only if every range still matches. Nothing staged is
visible to anyone: a stage only becomes a blob when the close that names it commits.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from objcache.errors import ObjcacheError

if TYPE_CHECKING:
    from objcache.cache.localfiles import LocalFile, LocalFiles
    from objcache.txn.coordinator import TxnClient
    from objcache.txn.dirtystore import DirtyStore

log = logging.getLogger(__name__)

ROUND = 4


@dataclass(eq=False)
class Staging:
    lf: LocalFile
    sid: str
    targets: list[str]
    staged: dict[str, int] = field(default_factory=dict)  # node -> bytes it holds
    end: int = 0  # bytes sealed for staging
    # (start, end, digest) of the staged ranges of a file written without us
    digests: list[tuple[int, int, bytes]] = field(default_factory=list)
    finishing: bool = False
    wake: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)


@dataclass(slots=True)
class Finished:
    """What a file's staging leaves for its close.

    staged: node -> (stage id, bytes of it the close's pull adopts: 0 when the file
        changed behind the stage).
    digests: (start, end, digest) of the staged ranges of a file written without us, as
        they are now (checked against the ones taken before the replicas pulled them).
    """

    staged: dict[str, tuple[str, int]]
    digests: list[tuple[int, int, bytes]]


class Stager:
    def __init__(self, txn: TxnClient, dirty: DirtyStore, local: LocalFiles,
                 step: int) -> None:
        self.txn = txn
        self.local = local
        self.dirty = dirty
        self.step = step  # stage when this many more bytes are complete
        self._by_fid: dict[int, Staging] = {}
        # fid -> (file, its version when a close took its staging): no new staging of
        # those bytes while that close seals and replicates them
        self._finished: dict[int, tuple[LocalFile, int]] = {}

    def poll(self, lf: LocalFile, nursery: trio.Nursery) -> None:
        st = self._by_fid.get(lf.fid)
        if st is not None:
            st.wake.set()
            return
        done = self._finished.get(lf.fid)
        if done is not None:
            if done[1] == lf.version:
                # Its close is under way (the handle that wrote it is still open until
                # the RELEASE): a new staging would have the replicas pull the whole file
                # a second time, beside the close's own pull (it did, for every
                # passthrough checkpoint, on 2026-11-27).
                return
            del self._finished[lf.fid]  # written since: what follows is new
        if (not lf.writers or lf.removed or lf.base_key is not None or lf.base_limit
                or lf.shared or lf.size < self.step or self.txn.replicas < 2):
            return
        targets = self.txn.stage_targets(lf.key)
        if not targets:
            return
        st = Staging(lf, uuid.uuid4().hex, targets)
        lf.sealed, lf.seal_broken = 0, False
        self._by_fid[lf.fid] = st
        self.dirty.expose(st.sid, lf.path)
        nursery.start_soon(self._drive, st)

    def sweep(self) -> None:
        for fid, (lf, _) in list(self._finished.items()):
            if lf.removed or not lf.dirty:
                del self._finished[fid]
        for fid, st in list(self._by_fid.items()):
            if st.lf.removed:
                del self._by_fid[fid]
                self._stop(st)
                self.dirty.unexpose(st.sid)

    def _stop(self, st: Staging) -> None:
        st.finishing = True
        st.wake.set()

    async def _drive(self, st: Staging) -> None:
        lf = st.lf
        try:
            while not (st.finishing or lf.seal_broken or lf.removed):
                # rounds of at most ROUND chunks: close() waits for the one in flight
                end = min(lf.size - lf.size % self.step, st.end + ROUND * self.step)
                if end > st.end:
                    if self.local.bypassed(lf):  # (before any byte of it is pulled)
                        st.digests.append((st.end, end,
                                           await self.local.digest(lf, st.end, end - st.end)))
                    lf.sealed = st.end = end  # before any byte of it is read

                    async def one(node: str, end: int = end) -> None:
                        try:
                            if await self.txn.stage(node, st.sid, end):
                                st.staged[node] = end
                        except ObjcacheError as e:
                            log.info("staging %r on %s failed (%s): close pulls it whole",
                                     lf.key, node, e)
                            st.targets.remove(node)

                    async with trio.open_nursery() as nursery:
                        for node in list(st.targets):
                            nursery.start_soon(one, node)
                    continue
                await st.wake.wait()
                st.wake = trio.Event()
        finally:
            st.ended.set()

    async def finish(self, lf: LocalFile) -> Finished:
        """Stop staging `lf` (about to be sealed): what the close's pull may adopt."""
        st = self._by_fid.pop(lf.fid, None)
        self._finished[lf.fid] = (lf, lf.version)
        if st is None:
            return Finished({}, [])
        self._stop(st)
        await st.ended.wait()
        usable = not (lf.seal_broken or lf.size < st.end)
        now: list[tuple[int, int, bytes]] = []
        if usable and st.digests:
            ranges = [(start, end) for start, end, _ in st.digests]
            got = await self.local.digests(lf.path, ranges)
            now = [(start, end, d) for (start, end), d in zip(ranges, got, strict=True)]
            usable = now == st.digests  # else written below the seal, through passthrough
        lf.sealed, lf.seal_broken = 0, False
        if not st.staged:
            self.dirty.unexpose(st.sid)
            return Finished({}, now if usable else [])
        if not usable:  # the replicas drop what they staged and pull the whole file
            log.info("%r changed behind what was staged: close pulls it whole", lf.key)
        return Finished({node: (st.sid, n if usable else 0) for node, n in st.staged.items()},
                        now if usable else [])

    def done(self, staged: dict[str, tuple[str, int]]) -> None:
        """The close's pulls are over: the working copy is no longer readable as a
        stage."""
        for sid, _ in staged.values():
            self.dirty.unexpose(sid)
