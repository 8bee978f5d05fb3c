"""The cluster backend: every namespace change is a Raft transaction, closed files are
replicated before close() returns, and each key's owner writes it back to S3.

What a node shows is S3 (through objcache.txn.overlay, which hides what was deleted) plus
the replicated namespace entries (objcache.txn.namespace): files closed but not uploaded,
new directories, renamed trees. Every change here is one command (TxnClient.submit); S3 is
brought up to date later by each key's owner (objcache.txn.flusher). Changes that other
nodes commit reach the core through `take_changes`, in log order.

close() of a written file seals its working copy into a blob, has `--replicas - 1` other
nodes pull it, then commits the entry that names the blob and its holders: after close
the file is on two nodes and every node opens the new content (close-to-open).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import trio

from objcache.backend.base import AttrsOf, Change, Moved, NsView, Stats
from objcache.backend.staging import Stager
from objcache.entries import (
    Attrs,
    DirEntry,
    Entry,
    FileEntry,
    FlushScope,
    NsChange,
    ObjectRef,
    Tombstone,
    attrs_wire,
    to_wire,
)
from objcache.errors import Gone, InDoubt, NoQuorum, ObjcacheError, StoreRefused
from objcache.raft.node import STATE_REPLACED
from objcache.store.meta import parse_meta
from objcache.ticks import next_tick, sleep_ticks
from objcache.txn.flusher import ClusterFlusher
from objcache.txn.overlay import OverlayStore

if TYPE_CHECKING:
    from objcache.cache.localfiles import LocalFile, LocalFiles
    from objcache.cache.quarantine import Quarantine
    from objcache.config import MountConfig
    from objcache.store import ObjectStore
    from objcache.txn.coordinator import TxnClient
    from objcache.txn.dirtystore import DirtyStore

log = logging.getLogger(__name__)

# How often a closed working copy the kernel wrote is looked at while a shared mapping may
# still write it (LocalFiles.BYPASS_WATCH): a change is committed like a close.
LINGER_LOOK = 0.5

DEFAULT_FILE_MODE = 0o100644
DEFAULT_DIR_MODE = 0o040755

# What the Raft group hands over per applied command: its namespace changes and the node
# that made it (objcache.txn.state.applied_changes).
Applied = tuple[list[NsChange], str | None]


class AppliedFeed(Protocol):
    """What the Raft group applied, in log order (objcache.cluster.raftgroup.AppliedFeed)."""

    def take(self) -> list[Applied]:
        """Everything handed over since the last call."""
        ...

    async def wait(self) -> None:
        """Return once `take` has something (taking nothing)."""
        ...


class ReplicatedBackend:
    def __init__(self, cfg: MountConfig, s3: ObjectStore, txn: TxnClient, dirty: DirtyStore,
                 local: LocalFiles, applied: AppliedFeed,
                 quarantine: Quarantine) -> None:
        self.raw = s3  # S3 itself, for existence checks that must see tombstoned keys
        self.store = OverlayStore(s3, txn)
        self.sync_is_local = False  # a catch-up is a barrier through the Raft log
        self.txn = txn
        self.dirty = dirty
        self.local = local
        self.flusher = ClusterFlusher(s3, txn, dirty, cfg.chunk_size, cfg.writeback_delay,
                                      local.space, quarantine, cfg.s3_retry_seconds)
        self.stager = Stager(txn, dirty, local, cfg.chunk_size)
        self._nursery: trio.Nursery | None = None
        self._applied = applied
        self.restore_wait = cfg.catch_up_seconds
        self._withdrawn: set[int] = set()  # working copies whose close failed (`_withdraw`)
        self.uid, self.gid = os.getuid(), os.getgid()  # owner of objects without metadata

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # Ready (mounted) once the copies this node held before it lost its cache
            # dir are back, at most --catch-up-seconds: a rolling restart that waits for
            # the mount then never replaces a file's last holder (objcache.txn.coordinator).
            restored = trio.Event()

            async def restore() -> None:
                await self.txn.restore_copies()
                restored.set()

            nursery.start_soon(restore)
            # (not caught up with the log: the mount has waited its bound already, and
            # the copies are pulled once it has)
            if self.txn.has_caught_up_once():
                with trio.move_on_after(self.restore_wait):
                    await restored.wait()
            if not restored.is_set():
                log.warning("mounting before this node's copies of closed files are pulled "
                            "again (%.0fs); they go on in the background", self.restore_wait)
            task_status.started()
            nursery.start_soon(self.flusher.run)
            nursery.start_soon(self.txn.settle_loop)
            await self._stage_while_writing(nursery)

    async def _stage_while_writing(self, nursery: trio.Nursery) -> None:
        """Wakes when a working copy completes a chunk (LocalFiles.changed): the likely
        replicas of files being written pull the new bytes (objcache.backend.staging).
        It also wakes when a writer starts to wait for room: write-back looks again at
        once rather than at its next tick, since only its uploads free that room."""
        while True:
            if self.local.space.waiting_for_room:
                self.flusher.wake.set()
            self.local.changed = trio.Event()
            self.stager.sweep()
            for lf in list(self.local.dirty_files()):
                if lf.writers and not lf.removed:
                    self.stager.poll(lf, nursery)
            with trio.move_on_at(next_tick(1.0)):
                await self.local.changed.wait()

    # -- what is known beyond S3 ------------------------------------------------------------

    def entry(self, key: str) -> FileEntry | DirEntry | None:
        st = self.txn.state
        with st.lock:
            e = st.ns.get(key)
        return None if e is None or isinstance(e, Tombstone) else e

    def live_under(self, prefix: str) -> bool:
        st = self.txn.state
        with st.lock:
            return st.ns.live_under(prefix)

    def view_under(self, prefix: str) -> NsView:
        st = self.txn.state
        with st.lock:
            under = list(st.ns.under(prefix))
        return NsView([(k, e) for k, e in under if not isinstance(e, Tombstone)],
                      frozenset(k for k, e in under if isinstance(e, Tombstone)))

    async def sync(self) -> bool:
        await self.txn.barrier()
        return True

    def take_changes(self) -> list[Change]:
        out: list[Change] = []
        me = self.txn.node_id
        for changes, by in self._applied.take():
            for c in changes:
                if c.resync:
                    out.append(Change(c.key, None, None, resync=True))
                    continue
                if c.uploaded is not None:
                    out.append(Change(c.key, None, c.uploaded))
                    if by != me and self.local.space.crowded:
                        # Another node's upload: our blob of it can go now, and a writer
                        # may wait for that room. (Our own clean wakes the flusher there.)
                        self.flusher.wake.set()
                    continue
                live = None if isinstance(c.entry, Tombstone) else c.entry
                out.append(Change(c.key, live, None, ours=by == me))
        return out

    async def wait_changes(self) -> None:
        await self._applied.wait()

    # -- namespace changes ------------------------------------------------------------------

    async def _submit(self, cmd: dict[str, Any]) -> int:
        """Commit one command; the log position it got (the entry's `ver`)."""
        res = await self.txn.submit(cmd)
        return int(res.get("ver", 0))

    async def create(self, key: str, attrs: Attrs, excl: bool) -> FileEntry | None:
        e = FileEntry(attrs, at=time.time())
        ver = await self._submit({"op": "ns.create", "key": key, "e": to_wire(e),
                                  "excl": excl})
        return replace(e, ver=ver)

    async def mkdir(self, key: str, attrs: Attrs) -> DirEntry | None:
        e = DirEntry(attrs, at=time.time())
        ver = await self._submit({"op": "ns.create", "key": key + "/", "e": to_wire(e)})
        return replace(e, ver=ver)

    async def make_node(self, key: str, attrs: Attrs, body: bytes) -> FileEntry | ObjectRef:
        e = FileEntry(attrs, len(body), target=body, at=time.time())
        ver = await self._submit({"op": "ns.create", "key": key, "e": to_wire(e)})
        return replace(e, ver=ver)

    async def _in_s3(self, key: str) -> bool:
        """Whether S3 holds an object at `key` that is not already tombstoned."""
        st = self.txn.state
        with st.lock:
            if isinstance(st.ns.get(key), Tombstone):
                return False
        return await self.raw.head(key) is not None

    async def unlink(self, key: str, maybe_in_s3: bool) -> None:
        await self.txn.submit({"op": "ns.unlink", "key": key, "s3": await self._in_s3(key)})

    async def rmdir(self, key: str, maybe_in_s3: bool) -> None:
        await self.txn.submit({"op": "ns.rmdir", "key": key + "/",
                               "s3": await self._in_s3(key + "/")})

    async def set_dir_attrs(self, key: str, attrs: Attrs) -> DirEntry | None:
        e = DirEntry(attrs, at=time.time())
        ver = await self._submit({"op": "ns.setdir", "key": key + "/", "e": to_wire(e)})
        return replace(e, ver=ver)

    async def set_file_attrs(self, key: str, current: FileEntry | ObjectRef, attrs: Attrs
                             ) -> FileEntry | ObjectRef:
        if isinstance(current, ObjectRef):
            # A clean S3 file: it gets a server-side copy with the new metadata.
            e = FileEntry(attrs, current.size, base=current, at=time.time())
        else:
            e = replace(current, attrs=attrs, at=time.time(), ver=0)
        ver = await self._submit({"op": "ns.commit", "key": key, "e": to_wire(e),
                                  "must_exist": isinstance(current, FileEntry)})
        return replace(e, ver=ver)

    async def rename(self, src: str, dst: str, is_dir: bool, replaces_dir: bool,
                     noreplace: bool, dir_attrs: Attrs | None, attrs_of: AttrsOf
                     ) -> list[Moved]:
        lf = self.local.by_key.get(src)
        if lf is not None and lf.dirty:
            await self.close(src, lf)  # what moves is what was written so far
        objects = await self._s3_objects(src, is_dir, attrs_of)
        d = dir_attrs
        await self.txn.submit({
            "op": "ns.rename", "src": src, "dst": dst, "dir": is_dir, "objects": objects,
            "noreplace": noreplace, "at": time.time(),
            "e": attrs_wire(d) if d is not None else None})
        dlf = self.local.by_key.get(dst)
        if dlf is not None and not replaces_dir:
            self.local.remove(dlf)
        for k in [k for k in self.local.by_key if k == src or k.startswith(src + "/")]:
            self.local.rekey(self.local.by_key[k], dst + k[len(src):])
        return []  # S3 follows at write-back

    async def _s3_objects(self, src: str, is_dir: bool, attrs_of: AttrsOf
                          ) -> list[list[Any]]:
        """The S3 objects a rename of `src` moves, with their attributes
        ([key, etag, size, mode, uid, gid, mtime_ns, atime_ns, ctime_ns, rdev])."""
        if not is_dir:
            if not await self._in_s3(src):
                return []
            info = await self.raw.head(src)
            if info is None:
                return []
            a = parse_meta(info.metadata or {}, DEFAULT_FILE_MODE, self.uid, self.gid,
                           info.mtime_ns)
            return [[src, info.etag, info.size, *_attr_list(a)]]
        out: list[list[Any]] = []
        async for o in self.store.list_recursive(src + "/"):
            # A LIST has no metadata: the entry shows what we know, or defaults (copies
            # keep the object's own at write-back).
            a = attrs_of(o.key) or Attrs(
                DEFAULT_DIR_MODE if o.key.endswith("/") else DEFAULT_FILE_MODE, self.uid,
                self.gid, o.mtime_ns)
            out.append([o.key, o.etag, o.size, *_attr_list(a)])
        return out

    # -- working copies -----------------------------------------------------------------------

    async def working_attrs_changed(self, lf: LocalFile) -> ObjectRef | None:
        self.local.mark_dirty(lf)  # committed with the content at close
        return None

    async def close(self, key: str, lf: LocalFile, final: bool = False
                    ) -> FileEntry | None:
        """Seal the content, replicate it, commit it (close() returns after)."""
        async with lf.lock:
            self.local.observe(lf)  # (writes the kernel made without us, if any)
            if not lf.dirty or lf.removed:
                return None
            version = lf.version
            await self.local.materialize_all(lf)
            cid = self.txn.new_cid()
            if not self.local.bypassed(lf):
                staged = (await self.stager.finish(lf)).staged
                # The blob is a hard link to the working copy: it takes over the bytes'
                # charge (a write after this copies the file, and charges the copy).
                self.local.hand_over_charge(lf)
                self.dirty.seal(cid, lf.path, lf.size)
                lf.shared = True
            elif final:
                staged = await self._finish_and_link(lf, cid)
            else:
                # The kernel writes this file without us (passthrough), and a handle open
                # for writing stays: the blob is a copy, made while the staged digests are
                # checked.
                staged = await self._finish_and_copy(lf, cid)
            try:
                holders = await self.txn.replicate(lf.key, cid, lf.size, staged)
            finally:
                self.stager.done(staged)
            e = FileEntry(lf.attrs, lf.size, cid,
                          tuple(holders), at=time.time())
            cmd = {"op": "ns.commit", "key": lf.key, "e": to_wire(e),
                   "must_exist": self.entry(lf.key) is not None}
            try:
                try:
                    ver = await self._submit(cmd)
                except NoQuorum as ex:
                    self._withdraw(lf, version, cid, ex)
                    raise
                except Gone:
                    if not await self._written_back_meanwhile(lf.key):
                        raise
                    # Its owner wrote back an earlier version (the empty file of the
                    # create) and forgot the entry: the file is still there, in S3. An
                    # unlink since then leaves a tombstone, which still refuses this.
                    ver = await self._submit(dict(cmd, must_exist=False))
            except Gone:
                log.info("%r was removed by another node while open here", lf.key)
                lf.dirty = False
                self.dirty.drop(cid)
                return None
            self.dirty.committed_here(cid)
            if lf.version == version:
                lf.dirty = False
                lf.dirty_since = None
                self.local.save(lf)
            log.debug("close of %r committed: blob %s, %d bytes, ver %d", lf.key, cid,
                      lf.size, ver)
            return replace(e, ver=ver)

    def _withdraw(self, lf: LocalFile, version: int, cid: str, ex: NoQuorum) -> None:
        """A close whose commit failed (EIO: fenced, it never takes effect) or is in doubt
        (ETIMEDOUT: only its fence decides): what it wrote is no longer this node's to
        commit. Left dirty, the working copy was committed again by the release that
        follows the failed close, or by the next close here, once the network healed:
        the failed write took effect after all (the partition nemesis; issue 27)."""
        if lf.version == version:
            lf.dirty = False
            lf.dirty_since = None
            self.local.save(lf)
        if not isinstance(ex, InDoubt):
            self.dirty.drop(cid)  # referenced by no entry, now or later
        self._withdrawn.add(lf.fid)
        log.warning("close of %r failed (%s): what it wrote is withdrawn", lf.key, ex)

    async def _written_back_meanwhile(self, key: str) -> bool:
        """Whether `key` has no entry (not even a tombstone) because its owner uploaded it
        and forgot the entry, rather than because it was unlinked."""
        st = self.txn.state
        with st.lock:
            if st.ns.get(key) is not None:
                return False  # a tombstone (unlinked), or something else now
        return await self.store.head(key) is not None

    async def fsync(self, key: str, lf: LocalFile) -> FileEntry | ObjectRef | None:
        """In a cluster, durable = replicated and committed (upload is the owner's)."""
        return await self.close(key, lf)

    async def _finish_and_link(self, lf: LocalFile, cid: str) -> dict[str, tuple[str, int]]:
        """Seal a file the kernel wrote without us, now that no handle open for writing
        is left: the blob is a hard link to the working copy (no copy). Something may
        still write the file unseen (a shared mapping outlives its close, a descriptor
        passed to another process), so the digests of what is committed are kept: before
        the working copy is written again the blob gets a file of its own, kept only if
        it still holds these bytes (`DirtyStore.detach`). A write the kernel makes
        meanwhile is taken in as a new version (`_linger`) and committed over this one."""
        fin = await self.stager.finish(lf)
        digests = fin.digests
        done = digests[-1][1] if digests else 0
        if lf.size > done or not digests:
            tail = [(done, lf.size)]
            digests = digests + [(done, lf.size, d)
                                 for d in await self.local.digests(lf.path, tail)]

        async def check(copy: str) -> bool:
            ranges = [(start, end) for start, end, _ in digests]
            return await self.local.digests(copy, ranges) == [d for *_, d in digests]

        async def detach() -> None:
            await self.dirty.detach(cid, lf.path, check)

        self.local.hand_over_charge(lf)  # (the blob's bytes from now on)
        self.dirty.seal(cid, lf.path, lf.size)
        lf.linked = detach
        if self.local.observe(lf):
            log.info("%r changed while its close sealed it", lf.key)
        return fin.staged

    async def _finish_and_copy(self, lf: LocalFile, cid: str) -> dict[str, tuple[str, int]]:
        staged: dict[str, tuple[str, int]] = {}

        async def finish() -> None:
            staged.update((await self.stager.finish(lf)).staged)

        async with trio.open_nursery() as n:
            n.start_soon(finish)
            n.start_soon(self.dirty.seal_copy, cid, lf.path, lf.size)
        if self.local.observe(lf):
            # Written while it was copied: the copy may mix before and after. The version
            # moved, so the file stays dirty and its next close commits what follows.
            log.info("%r changed while its close sealed it", lf.key)
        return staged

    def released(self, lf: LocalFile) -> None:
        if lf.dirty or lf.opens:
            return
        if lf.fid in self._withdrawn:
            # Its last close failed: the file is what the log says, not this copy (which
            # would go on answering reads here while watched for mapping writes).
            self._withdrawn.discard(lf.fid)
            self.local.remove(lf)
            return
        if self.local.bypassed(lf) and self._nursery is not None:
            # A shared mapping may write it after its last close, and the kernel tells
            # us nothing of it: it is looked at until that watch ends.
            self._nursery.start_soon(self._linger, lf)
        else:
            self.local.remove(lf)  # the sealed blob keeps the content

    async def _linger(self, lf: LocalFile) -> None:
        while not lf.removed and lf.opens == 0 and self.local.bypassed(lf):
            await sleep_ticks(LINGER_LOOK)
            self.local.observe(lf)
            if lf.dirty and lf.opens == 0 and not lf.removed:
                log.info("%r changed after its last close (a shared mapping?): committing "
                         "it", lf.key)
                try:
                    # written through a mapping: commit it
                    await self.close(lf.key, lf, final=lf.writers == 0)
                except (ObjcacheError, OSError) as e:  # (removed meanwhile: OSError)
                    log.error("could not commit what was written to %r through a mapping "
                              "after its close: %s", lf.key, e)
        if lf.opens == 0 and not lf.dirty and not lf.removed:
            self.local.remove(lf)

    async def read_blob(self, e: FileEntry, offset: int, length: int) -> bytes:
        assert e.cid is not None
        return await self.txn.read_blob(e.cid, list(e.holders), offset, length)

    # -- write-back -------------------------------------------------------------------------

    async def flush(self, scope: FlushScope) -> int:
        return await self.flusher.flush(scope)

    async def drain(self) -> int:
        refused: StoreRefused | None = None
        try:
            n = await self.flusher.flush(FlushScope.mine())
        except StoreRefused as e:  # quarantined: the rest still goes up
            refused, n = e, 0
        if len(self.txn.node.membership.ring) <= 1:
            # The last node: everything is ours (scale to zero).
            n += await self.flusher.flush(FlushScope.everything())
        if refused is not None:
            raise refused
        return n

    def stats(self) -> Stats:
        files, nbytes, oldest = self.flusher.dirty_summary()
        return Stats(files, nbytes, oldest, self.flusher.uploaded, self.flusher.failed,
                     quarantined=self.flusher.quarantine.count,
                     in_doubt=tuple(self.txn.in_doubt.values()),
                     settled=tuple(self.txn.settled))


def _attr_list(a: Attrs) -> list[int]:
    return [a.mode, a.uid, a.gid, a.mtime_ns, a.atime_ns, a.ctime_ns, a.rdev]


def applied_changes(state: Any, cmd: dict[str, Any]) -> Applied | None:
    """On the Raft thread, after each applied command: what it changed in the namespace
    and who made it (for RaftGroup's `applied` feed). A snapshot that replaced the state
    (STATE_REPLACED) changed every key whose entry differs between the two."""
    if cmd.get("op") == STATE_REPLACED:
        return replaced_changes(cmd["old"].ns.entries, state.ns.entries), None
    changes = state.last_changes
    if not changes:
        return None
    by = cmd.get("by")
    return list(changes), by if isinstance(by, str) else None


def replaced_changes(old: dict[str, Entry], new: dict[str, Entry]) -> list[NsChange]:
    """The changes from namespace `old` to namespace `new` (a snapshot a node that fell
    behind took): a key whose entry differs has the new one; a key whose entry is gone
    (written back, or deleted and then cleaned while we were behind) is `resync`; a
    tombstone that went stays gone. Without these a learner that took a snapshot after
    its mount showed unlinked files and missed renamed ones until restarted (the
    partition nemesis with learners, seed 4309)."""
    out = [NsChange(k, e) for k, e in new.items() if old.get(k) != e]
    out += [NsChange(k, None, resync=True) for k, e in old.items()
            if k not in new and not isinstance(e, Tombstone)]
    return out
