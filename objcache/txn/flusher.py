"""Cluster write-back: each node uploads the namespace entries it owns.

The owner of a key (consistent hashing over the live members) brings S3 in line with its
entry once the write-back delay has passed, or at once when asked (flush, drain):
(Or at once when the cache is crowded: writers waiting for room wait for these uploads.)
- a file with a blob: multipart upload (one part per chunk) from our copy of the blob,
  pulled first from a holder if we have none (which also adds a replica);
- a renamed or re-attributed clean file: a server-side copy from its old object, on the
  condition that the old object is still the version the entry names;
- a directory: its marker; an empty file or a symlink: a small PUT;
- a tombstone: DeleteObject, once no entry still reads the object as its base (and a key
  that others read as their base is not overwritten until they have copied it).
Then `ns.clean` commits that the entry is in S3, and it only succeeds if the entry is still
the version uploaded, so a write racing an upload stays dirty. Nodes that disagree about the
owner during a membership change (and a flush or a crowded cache, which upload what they
can) may both get to a key: right before the one S3 call that makes a version visible (a
PUT, a multipart upload's completion, a copy, a delete) a node claims the key for that
version in the log (`ns.claim`, objcache.txn.namespace), so only one node writes a key at a
time and a slow write of an older version can never land over a newer one. A blob of more
than one part is claimed before its bytes move too, so the other node does not pull and
upload it in vain.
An entry S3 refuses for good (objcache.cache.quarantine) is quarantined after a few
refusals (at the first when a flush or drain asks): its bytes go to this node's
lost+found/, and a commit drops the entry, so the key shows S3's version again on every
node. Nothing else is ever dropped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from objcache.entries import DirEntry, Entry, FileEntry, FlushScope, Tombstone
from objcache.errors import NoQuorum, ObjcacheError, StaleObject, StoreError, StoreRefused
from objcache.store.meta import make_meta
from objcache.store.s3 import attempt_timeout
from objcache.ticks import next_tick

if TYPE_CHECKING:
    from objcache.cache.chunks import ChunkCache
    from objcache.cache.quarantine import Quarantine
    from objcache.store import ObjectStore
    from objcache.txn.coordinator import TxnClient
    from objcache.txn.dirtystore import DirtyStore

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE = 5.0  # at most; sooner with a shorter write-back delay
GC_EVERY = 2.0


class Busy(Exception):
    """Another node is writing the key to S3 now, or its entry moved on: later."""


class ClusterFlusher:
    def __init__(self, store: ObjectStore, txn: TxnClient, dirty: DirtyStore,
                 chunk_size: int, delay: float, space: ChunkCache,
                 quarantine: Quarantine, s3_seconds: float = 60.0) -> None:
        self.quarantine = quarantine
        # How long a claim holds: longer than one S3 call with all its retries can take
        # (the last attempt may start just before the budget ends and then wait its own
        # timeout, a quarter of the budget within 5-30 s: objcache.store.s3), with room
        # for clocks a little apart.
        self.lease = s3_seconds + attempt_timeout(s3_seconds) + 5.0
        self.retry_after = min(RETRY_AFTER_FAILURE, max(0.5, delay))
        self.store = store
        self.txn = txn
        self.dirty = dirty
        self.chunk_size = chunk_size
        self.delay = delay
        self.space = space  # crowded: closed files we own go up now, not after the delay
        self.uploads = trio.CapacityLimiter(16)
        self.wake = trio.Event()
        self._running: set[str] = set()
        self._failed: dict[str, float] = {}
        # the last failure, by key: when its attempt began, and the error
        self._errors: dict[str, tuple[float, ObjcacheError]] = {}
        self._urgent: set[str] | None = set()  # keys asked for now; None: everything
        self._claimed: set[str] = set()  # keys we hold a claim on and have not cleaned
        self.uploaded = 0
        self.failed = 0

    def _snapshot(self) -> list[tuple[str, Entry]]:
        st = self.txn.state
        with st.lock:
            return list(st.ns.entries.items())

    def _referenced(self, key: str) -> bool:
        st = self.txn.state
        with st.lock:
            return st.ns.referenced(key)

    def _due(self, key: str, e: Entry, now: float, mine: bool) -> bool:
        if key in self._running or now - self._failed.get(key, -1e9) < self.retry_after:
            return False
        urgent = self._urgent is None or key in self._urgent
        if (self.space.crowded and isinstance(e, FileEntry) and e.cid is not None
                and self.dirty.has(e.cid)):
            # Writers here wait for room, which only uploads free: a blob we hold goes up
            # now even if another node owns its key (both uploading is harmless: the
            # content is the same, and one clean wins).
            return True
        if not mine and not urgent:
            return False
        return urgent or isinstance(e, Tombstone) or time.time() - e.at >= self.delay

    async def run(self) -> None:
        last_gc = 0.0
        async with trio.open_nursery() as nursery:
            while True:
                self.wake = trio.Event()
                if self.txn.caught_up():
                    now = time.monotonic()
                    for key, e in self._snapshot():
                        mine = self.txn.owner(key) == self.txn.node_id
                        if self._due(key, e, now, mine):
                            self._running.add(key)
                            nursery.start_soon(self._one, key, e)
                    # Crowded: what uploads free is dropped at once (writers wait on it).
                    if now - last_gc > GC_EVERY or self.space.crowded:
                        last_gc = now
                        st = self.txn.state
                        with st.lock:
                            referenced = st.ns.cids()
                        self.dirty.gc(referenced)
                with trio.move_on_at(next_tick(0.5)):
                    await self.wake.wait()

    async def _one(self, key: str, e: Entry) -> None:
        began = time.monotonic()
        try:
            async with self.uploads:
                await self.upload(key, e)
            self.quarantine.forgive(key)
        except Busy as b:
            self._failed[key] = time.monotonic()  # looked at again after retry_after
            log.debug("write-back of %r deferred: %s", key, b)
            self._errors.pop(key, None)
        except StoreRefused as ex:
            self.failed += 1
            self._failed[key] = time.monotonic()
            urgent = self._urgent is None or key in self._urgent
            if self.quarantine.refused(key) or urgent:
                await self._quarantine(key, e, str(ex))
            else:
                log.error("S3 refused %r (retried in %gs, then quarantined): %s", key,
                          self.retry_after, ex)
        except ObjcacheError as ex:
            self.failed += 1
            self._failed[key] = time.monotonic()
            self._errors[key] = (began, ex)
            log.warning("write-back of %r failed (it stays dirty, retried in %gs): %s",
                        key, self.retry_after, ex)
        except Exception:
            self.failed += 1
            self._failed[key] = time.monotonic()
            log.exception("unexpected error writing back %r", key)
        finally:
            self._running.discard(key)
            if key in self._claimed:
                self._claimed.discard(key)
                with trio.CancelScope(shield=True), trio.move_on_after(self.txn.timeout):
                    try:
                        await self.txn.submit({"op": "ns.release", "key": key,
                                               "node": self.txn.node_id}, background=True)
                    except ObjcacheError:
                        pass  # it expires

    async def _quarantine(self, key: str, e: Entry, error: str) -> None:
        """Keep the refused entry's bytes here, then drop the entry (if it is still the
        version that was refused)."""
        q = self.quarantine

        async def drop() -> None:
            await self.txn.submit({"op": "ns.clean", "key": key, "ver": e.ver,
                                   "etag": None, "stored": False}, background=True)

        if isinstance(e, FileEntry) and e.cid:
            if not self.dirty.has(e.cid):
                await self.txn.pull(e.cid, e.size, list(e.holders))
            await q.put(key, str(self.dirty.path(e.cid)), e.size, error, drop)
        elif isinstance(e, FileEntry) and e.base:
            # A renamed S3 object whose copy is refused: its bytes, before the tombstone
            # of its old key may delete them.
            base = e.base

            async def piece(off: int, n: int) -> bytes:
                return await self.store.get_range(base.key, base.etag, off, n)

            await q.put_pieces(key, base.size, error, piece, drop)
        elif isinstance(e, FileEntry) and e.target is not None:
            body = e.target

            async def whole(off: int, n: int) -> bytes:
                return body[off:off + n]

            await q.put_pieces(key, len(body), error, whole, drop)
        else:
            await q.put(key, None, 0, error, drop)  # a marker, a delete: no bytes

    async def _claim(self, key: str, e: Entry) -> None:
        """The right to write `key` to S3 at version `e.ver` now (see the module
        docstring); Busy if another node has it or the entry moved on."""
        res = await self.txn.submit({"op": "ns.claim", "key": key, "ver": e.ver,
                                     "node": self.txn.node_id, "at": time.time(),
                                     "lease": self.lease}, background=True)
        # (what each claim got, and how far this node had applied the log then: how an
        # object came to be in S3 under a key the log says is gone is read from these)
        log.debug("claim of %r at ver %d: %s (applied through %d)", key, e.ver, res,
                  self.txn.state.applied)
        if not res.get("ok"):
            raise Busy("the entry changed since" if res.get("stale")
                       else f"{res.get('by')} is writing it")
        self._claimed.add(key)

    async def upload(self, key: str, e: Entry) -> None:
        """Bring S3 in line with entry `e` of `key`, then commit that it is clean."""
        if self._referenced(key):
            return  # someone's base still needs the current object here: later
        etag: str | None = None
        if isinstance(e, Tombstone):
            await self._claim(key, e)
            await self.store.delete(key)
        elif isinstance(e, DirEntry):
            await self._claim(key, e)
            await self.store.put_bytes(key, b"", make_meta(e.attrs))
        elif isinstance(e, FileEntry):
            meta = make_meta(e.attrs)
            if e.target is not None:
                await self._claim(key, e)
                etag = await self.store.put_bytes(key, e.target, meta)
            elif e.cid:
                # Claimed before the bytes move as well: two nodes that both want the key
                # (its owner, and a node whose flush made it urgent) would otherwise both
                # pull and upload it, and the loser's blob is dropped under it once the
                # winner's clean lands. The claim before the completion still decides.
                # (Not for a file of one part: one more log entry would cost more than
                # a second small PUT.)
                if e.size > self.chunk_size:
                    await self._claim(key, e)
                if not self.dirty.has(e.cid):
                    await self.txn.pull(e.cid, e.size, list(e.holders))
                    await self.txn.submit({"op": "ns.holders", "key": key, "cid": e.cid,
                                           "add": [self.txn.node_id]}, background=True)
                try:
                    etag = await self.store.put_file(
                        key, str(self.dirty.path(e.cid)), e.size, meta, self.chunk_size,
                        fence=lambda: self._claim(key, e))
                except FileNotFoundError:
                    if self._still(key, e):
                        raise
                    # (a claim outlived by a long upload: the other node's clean came
                    # first, and the blob went with the entry)
                    raise Busy("the entry changed since") from None
            elif e.base:
                await self._claim(key, e)
                try:
                    etag = await self.store.copy(e.base.key, key, meta,
                                                 src_etag=e.base.etag)
                except StaleObject:
                    raise StoreError(f"the object {e.base.key!r} that {key!r} was renamed "
                                     "from changed in S3 behind the cluster's back") from None
            else:
                await self._claim(key, e)
                etag = await self.store.put_bytes(key, b"", meta)
        res = await self.txn.submit({"op": "ns.clean", "key": key, "ver": e.ver,
                                     "etag": etag, "node": self.txn.node_id}, background=True)
        log.debug("clean of %r at ver %d (%s in S3): %s", key, e.ver,
                  "deleted" if isinstance(e, Tombstone) else f"etag {etag}", res)
        self._claimed.discard(key)
        if res.get("ok"):
            self.uploaded += 1
            if self.space.crowded:
                self.wake.set()  # the loop drops the blob now: a writer may wait on it
        else:
            log.debug("%r changed while it was written back; it stays dirty", key)

    def _still(self, key: str, e: Entry) -> bool:
        """Whether `e` is still `key`'s entry (the same version)."""
        st = self.txn.state
        with st.lock:
            cur = st.ns.get(key)
        return cur is not None and cur.ver == e.ver

    async def flush(self, scope: FlushScope, deadline: float | None = None) -> int:
        """Write back now and return once done: every entry in the cluster (the last node
        of a cluster, scale to zero), what we own or hold a blob of (a node about to
        leave), or one key and what is under it. Returns the entries flushed. Raises
        StoreError past the deadline."""
        flushed = 0
        added: set[str] = set()
        seen = self.quarantine.count

        def in_scope(key: str) -> bool:  # (what this node did: every key it wrote back)
            return scope.kind == "mine" or scope.covers(key)

        started = time.monotonic()
        behind_since: float | None = None
        try:
            while True:
                todo = [(k, e) for k, e in self._snapshot() if self._wanted(k, e, scope)]
                # Not caught up with the log (too few members up): nothing can be written
                # back, and what this node knows may lack entries committed without it
                # (so "nothing dirty here" proves nothing); waiting forever would hang
                # flush, umount and SIGTERM.
                caught_up = self.txn.caught_up()
                if caught_up:
                    behind_since = None
                elif behind_since is None:
                    behind_since = time.monotonic()
                elif time.monotonic() - behind_since > self.txn.timeout:
                    raise NoQuorum(f"{len(todo)} entries are dirty here, and this node has "
                                   f"not caught up with the cluster's log for "
                                   f"{self.txn.timeout:.0f}s (too few members up?)")
                if not todo and caught_up and any(in_scope(k) for k in self._running):
                    # A write-back still running whose entry is gone already: a quarantine
                    # drops the entry, then writes its note (an fsync) and only then
                    # counts it; returning now reported a refused file as flushed (a
                    # clean-clone CI run with the disk busy).
                    if deadline is not None and time.monotonic() > deadline:
                        raise StoreError("a write-back in the flush's scope is still "
                                         "running after the flush timeout")
                    await trio.sleep(0.02)
                    continue
                if not todo and caught_up:
                    self.quarantine.raise_if_refused(seen, in_scope)
                    return flushed
                if not todo:
                    await trio.sleep(0.2)
                    continue
                flushed = max(flushed, len(todo))
                self._raise_failures(todo, started)
                await self._push(todo, deadline, added)
        finally:
            if self._urgent is not None:
                self._urgent -= added

    def _raise_failures(self, todo: list[tuple[str, Entry]], since: float) -> None:
        """A write-back in scope begun since `since` (the flush's start) that failed
        (after the store's own retry budget) fails the flush; the entry stays dirty and
        is retried. One begun before is not the flush's: a claim submitted on a leader
        cut off from its peers failed 2 s after the heal, inside a flush that had waited
        for it and then failed for it (the partition nemesis, seed 5963); the flush
        waits for its retry instead, up to its deadline."""
        failed = [(k, self._errors[k][1]) for k, _ in todo
                  if k in self._errors and self._errors[k][0] >= since]
        if failed:
            key, err = failed[0]
            raise StoreError(f"write-back of {key!r} failed ({len(failed)} in all; they stay "
                             f"dirty and are retried): {err}")

    async def _push(self, todo: list[tuple[str, Entry]], deadline: float | None,
                    added: set[str]) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise StoreError(f"{len(todo)} entries are still dirty after the flush timeout")
        keys = {k for k, _ in todo}
        for k in keys - added:
            self._failed.pop(k, None)  # asked for now: no waiting out an earlier failure
        if self._urgent is not None:
            self._urgent |= keys
        added |= keys
        self.wake.set()
        await trio.sleep(0.05)

    def _wanted(self, key: str, e: Entry, scope: FlushScope) -> bool:
        if scope.kind == "mine":
            return (self.txn.owner(key) == self.txn.node_id
                    or (isinstance(e, FileEntry) and e.cid is not None
                        and self.dirty.has(e.cid)))
        return scope.covers(key)

    def dirty_summary(self) -> tuple[int, int, float | None]:
        """(entries this node owns, their bytes, age of the oldest) for status."""
        mine = [e for k, e in self._snapshot()
                if self.txn.owner(k) == self.txn.node_id]
        now = time.time()
        oldest = min((e.at or now for e in mine), default=None)
        return len(mine), sum(e.size for e in mine if isinstance(e, FileEntry)), \
            None if oldest is None else round(now - oldest, 1)
