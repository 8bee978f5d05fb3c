"""What the daemon does for `objcache status/flush/prefetch/unpin/evict/drain/umount`:
the handlers behind the control channel (objcache.control).

Read-only requests (status, resolving a path, listing for prefetch) are open to anyone
who can reach the mount; the others need root or the mount's owner (a plain prefetch,
which only warms the cache, is open too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from objcache.entries import FlushScope
from objcache.errors import StoreRefused, UserError

if TYPE_CHECKING:
    from objcache.cache.pins import Pins
    from objcache.cache.router import ChunkRouter
    from objcache.core.filesystem import Filesystem
    from objcache.status import ClusterStatus, NodeStatus
    from objcache.store import ObjectStore

log = logging.getLogger(__name__)

MAX_LIST_PAGE = 5000


class ControlHandlers:
    def __init__(self, fs: Filesystem, store: ObjectStore, router: ChunkRouter, pins: Pins,
                 status: NodeStatus, cluster: ClusterStatus,
                 leave: Callable[[], None]) -> None:
        self.fs = fs
        self.store = store
        self.router = router
        self.pins = pins
        self.status = status
        self.cluster = cluster
        self.leave = leave  # unmount and exit once the current request is answered

    async def __call__(self, req: dict[str, Any], uid: int) -> dict[str, Any]:
        op = req.get("op")
        if op == "status":
            return await self.status.status(local=bool(req.get("local")))
        if op == "resolve":
            return self.resolve(int(req["ino"]))
        if op == "list":
            return await self.list_files(str(req["prefix"]), str(req.get("after", "")),
                                         int(req.get("limit", 1000)))
        if uid not in (0, os.getuid()) and (op != "prefetch" or req.get("pin")):
            raise UserError("permission denied: only root or the mount's owner may do this")
        if op == "prefetch":
            files = req.get("files")
            if not (isinstance(files, list) and all(
                    isinstance(f, list) and len(f) == 3 and isinstance(f[0], str)
                    and isinstance(f[1], int) and isinstance(f[2], str) for f in files)):
                raise UserError("malformed prefetch request: files must be [key, size, etag]")
            return await self.prefetch(files, bool(req.get("pin")))
        if op in ("unpin", "evict"):
            return await self.unpin_or_evict(op, str(req["prefix"]))
        if op == "verify":
            return await self.verify(str(req["prefix"]))
        if op == "flush":
            # The file or directory named by inode (works through bind mounts); the
            # mount's root is everything.
            scope = FlushScope.under(self.fs.key_of(int(req["ino"])) if "ino" in req else "")
            t0 = time.monotonic()
            n = await self.fs.flush_scope(scope)
            return {"ok": True, "flushed": n, "seconds": round(time.monotonic() - t0, 3)}
        if op in ("drain", "unmount"):
            if op == "drain" and not self.cluster.is_member:
                raise UserError("drain is for cluster members (mounted with --listen); "
                                "use umount")
            try:
                result = await self.drain()
            except StoreRefused as e:
                # Everything else is in S3 and the refused files are in the quarantine:
                # leave anyway, and say which files did not make it.
                self.leave()
                raise UserError(f"unmounted; {e}") from None
            self.leave()
            return {"ok": True, "pid": os.getpid(), **result}
        raise UserError(f"unknown control request {op!r}")

    async def drain(self) -> dict[str, Any]:
        """Write back everything this node owns or holds (all of it on one node)."""
        t0 = time.monotonic()
        n = await self.fs.drain()
        secs = round(time.monotonic() - t0, 3)
        log.info("drained: %d written back in %.2fs", n, secs)
        return {"flushed": n, "seconds": secs}

    def resolve(self, ino: int) -> dict[str, Any]:
        """What a path (by inode number, which works through bind mounts) is in S3 terms."""
        inode = self.fs.inode(ino)
        is_dir = stat.S_ISDIR(inode.mode)
        written_here = inode.key in self.fs.local.by_key
        return {"ok": True, "key": inode.key, "dir": is_dir, "size": inode.size,
                "etag": None if is_dir or written_here else inode.etag}

    async def list_files(self, prefix: str, after: str, limit: int) -> dict[str, Any]:
        """One page of the objects under a directory, straight from S3 (no per-file HEAD)."""
        files: list[list[Any]] = []
        base = prefix + "/" if prefix else ""
        last = None
        async with contextlib.aclosing(self.store.list_recursive(base, after)) as objs:
            async for o in objs:
                last = o.key
                if not o.key.endswith("/"):  # directory markers hold no data
                    files.append([o.key, o.size, o.etag])
                if len(files) >= min(limit, MAX_LIST_PAGE):
                    break
            else:
                last = None
        return {"ok": True, "files": files, "next": last}

    async def prefetch(self, files: list[Any], pin: bool) -> dict[str, Any]:
        """Warm (and pin) whole files: every chunk is fetched by its owner. Per file:
        [bytes fetched now, bytes that were cached already, error or None]."""
        refs: list[tuple[str, str, int, int]] = []
        spans: list[tuple[int, int]] = []
        cs = self.router.chunk_size
        for key, size, etag in files:
            first = len(refs)
            refs += [(str(key), str(etag), int(size), i) for i in range(-(-int(size) // cs))]
            spans.append((first, len(refs)))
        outcomes = await self.router.ensure_many(refs, pin)
        results: list[list[Any]] = []
        totals = self.status.prefetch
        for (_, size, _), (a, b) in zip(files, spans, strict=True):
            fetched = cached = 0
            error = None
            for ref, outcome in zip(refs[a:b], outcomes[a:b], strict=True):
                n = self.router.cache.chunk_len(int(size), ref[3])
                if outcome == "fetched":
                    fetched += n
                elif outcome == "cached":
                    cached += n
                else:
                    error = error or outcome
            if error is None:
                totals.ok += 1
            else:
                totals.failed += 1
            totals.bytes += fetched
            results.append([fetched, cached, error])
        return {"ok": True, "results": results}

    async def _everywhere(self, op: str, prefix: str, here: dict[str, int]) -> dict[str, Any]:
        """`here` (this node's counts) summed with every other node's reply to op; the
        nodes that did not answer are listed as "unreachable"."""
        totals, unreachable = dict(here), []
        for node, reply in (await self.cluster.broadcast({"op": op, "prefix": prefix})
                            ).items():
            if reply is None:
                unreachable.append(node)
                continue
            for k in totals:
                totals[k] += int(reply.get(k, 0))
        return {"ok": True, **totals, "unreachable": unreachable}

    async def verify(self, prefix: str) -> dict[str, Any]:
        """Check every cached chunk under `prefix` (on every node) against its sums; the
        corrupt ones are dropped (fetched again when read; never a passthrough file)."""
        checked, nbytes, corrupt = await self.router.cache.verify(prefix)
        return await self._everywhere("verify", prefix,
                                      {"chunks": checked, "bytes": nbytes, "corrupt": corrupt})

    async def unpin_or_evict(self, op: str, prefix: str) -> dict[str, Any]:
        if op == "unpin":
            total, kept = self.pins.unpin(prefix), 0
        else:
            total, kept = await self.pins.evict(prefix)
        return await self._everywhere(op, prefix, {"bytes": total, "pinned_kept": kept})
