"""The mount daemon: checks, builds the components, runs FUSE, and shuts down cleanly.

Start-up refuses bad input before anything is mounted (a missing bucket, wrong
credentials, an unreachable endpoint, a busy or non-empty mountpoint, a cache dir in use by
another daemon). SIGTERM and SIGINT behave like `objcache umount`: upload every dirty file,
then unmount and exit; a Kubernetes preStop hook relies on that.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from objcache import __version__
from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.statedb import StateDB
from objcache.cluster.node import ClusterNode, bind_listener, load_secret, raft_address
from objcache.config import MountConfig
from objcache.control import ControlChannel
from objcache.core.clusterfs import ClusterFilesystem
from objcache.core.filesystem import Filesystem
from objcache.core.writeback import Writeback
from objcache.errors import ObjcacheError, UserError, unwrap
from objcache.fs.operations import KernelNotifier, Operations, mount_options, set_read_ahead
from objcache.store.s3 import S3Store
from objcache.txn.coordinator import TxnClient
from objcache.txn.dirtystore import DirtyStore
from objcache.txn.flusher import ClusterFlusher
from objcache.txn.overlay import OverlayStore

log = logging.getLogger(__name__)


def setup_logging(level: str, log_file: str | None) -> None:
    handler: logging.Handler = (logging.FileHandler(log_file) if log_file
                                else logging.StreamHandler(sys.stderr))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
        "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # botocore at DEBUG prints request headers (signatures, tokens): never let it.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("pyfuse3").setLevel(logging.INFO)


def is_mountpoint_busy(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def _is_dead_mount(path: str) -> bool:
    """A FUSE mount whose daemon is gone (stat may still answer from cached attributes;
    statvfs has to ask the daemon)."""
    try:
        os.statvfs(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def check_mountpoint(path: str, recover: bool = False) -> None:
    if recover and is_mountpoint_busy(path) and _is_dead_mount(path):
        # The mount of a daemon that died (a restarted pod): detach it and take over.
        # Bind mounts of it in running pods are re-pointed by the CSI plugin.
        log.warning("mountpoint %s is a dead mount of a previous daemon: detaching it", path)
        r = subprocess.run(["umount", "-l", path], capture_output=True, text=True,
                           check=False)
        if r.returncode != 0:
            raise UserError(f"cannot detach the dead mount at {path}: {r.stderr.strip()}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"mountpoint {path} does not exist") from None
    except OSError as e:
        raise UserError(f"mountpoint {path} is not usable: {e.strerror} "
                        "(a dead mount? run: fusermount3 -uz " + path + ")") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"mountpoint {path} is not a directory")
    if is_mountpoint_busy(path):
        raise UserError(f"mountpoint {path} is busy: something is already mounted there")
    if os.listdir(path):
        raise UserError(f"mountpoint {path} is not empty")


class CacheDir:
    """The cache directory: exclusive lock, identity check, layout."""

    def __init__(self, cfg: MountConfig) -> None:
        self.path = Path(cfg.cache_dir or cfg.default_cache_dir())
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise UserError(f"cache dir {self.path} is not usable: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"cache dir {self.path} is in use by another objcache daemon") \
                from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        ident = {"bucket": cfg.bucket, "prefix": cfg.prefix,
                 "chunk_size": cfg.chunk_size}
        id_file = self.path / "identity.json"
        if id_file.exists():
            old = json.loads(id_file.read_text())
            if {k: old.get(k) for k in ident} != ident:
                raise UserError(
                    f"cache dir {self.path} belongs to s3://{old.get('bucket')}/"
                    f"{old.get('prefix', '')} (chunk size {old.get('chunk_size')}); use "
                    "another --cache-dir")
        else:
            id_file.write_text(json.dumps(ident))


class Daemon:
    def __init__(self, cfg: MountConfig) -> None:
        self.cfg = cfg
        # Resolved now: once mounted, resolving it would stat our own mount.
        self.mountpoint = os.path.realpath(cfg.mountpoint)
        self.started = time.time()
        self.unmount_requested = False
        self.prefetch_stats = [0, 0, 0]  # files done, files failed, bytes fetched

    def prepare(self) -> None:
        """Everything that can fail because of user input, before mounting."""
        cfg = self.cfg
        check_mountpoint(self.mountpoint, cfg.recover_mount)
        self.store = S3Store(cfg.bucket, cfg.prefix, cfg.endpoint_url, cfg.region,
                             cfg.s3_concurrency, cfg.s3_retry_seconds)
        self.store.check_bucket()
        self.cache_dir = CacheDir(cfg)
        self.db = StateDB(self.cache_dir.path / "state.db")
        self.chunks = ChunkCache(self.db, self.cache_dir.path, cfg.cache_size, cfg.chunk_size,
                                 self.store, near_capacity=cfg.near_cache_size or 0)
        self.cluster: ClusterNode | None = None
        if cfg.listen:
            key = load_secret(cfg.cluster_secret_file)
            bind_listener(raft_address(cfg)).close()  # a taken Raft port fails here, clearly
            self.cluster = ClusterNode(cfg, key, self.chunks, bind_listener(cfg.listen),
                                       self.cache_dir.path / "raft")
            self.cluster.local_stats = self.node_stats
        self.local = LocalFiles(self.db, self.cache_dir.path, self.chunks)
        self.flusher: ClusterFlusher | None = None
        if self.cluster is not None:
            self._discard_unclosed()
            chunks = self.chunks

            def charge(n: int) -> bool:
                if not chunks.make_room(n):
                    return False
                chunks.local_bytes += n
                return True

            def release(n: int) -> None:
                chunks.local_bytes -= n

            self.dirty = DirtyStore(self.cache_dir.path, charge, release)
            self.txn = TxnClient(self.cluster, self.dirty, cfg.replicas, cfg.txn_timeout)
            self.fs: Filesystem = ClusterFilesystem(
                cfg, OverlayStore(self.store, self.txn), self.chunks, self.local, self.txn,
                self.dirty)
            self.flusher = ClusterFlusher(self.store, self.txn, self.dirty, cfg.chunk_size,
                                          cfg.writeback_delay)
            self.cluster.on_ns_changes = self.fs.apply_changes
        else:
            self.fs = Filesystem(cfg, self.store, self.chunks, self.local)
        self.writeback = Writeback(cfg, self.store, self.local, self.fs.uploaded)
        self.control = ControlChannel(self.handle_control)
        if cfg.metrics_addr:
            from objcache import metrics
            self.metrics_server = metrics.serve(cfg.metrics_addr, self)
        self.ops = Operations(self.fs, self.writeback, self.control)

    def _discard_unclosed(self) -> None:
        """In a cluster a file is committed at close(); working copies left by a crash
        were never closed (never acknowledged): they go, like unsynced writes."""
        n = 0
        for lf in list(self.local.by_key.values()):
            if lf.dirty:
                n += 1
            self.local.remove(lf)
        if n:
            log.warning("discarded %d files that were open for writing when the previous "
                        "daemon died (never closed, so never committed)", n)

    async def drain(self) -> dict[str, Any]:
        """Write back everything we own or hold, so leaving loses nothing."""
        assert self.flusher is not None and isinstance(self.fs, ClusterFilesystem)
        t0 = time.monotonic()
        await self.fs.flush_open_files()
        n = await self.flusher.flush("mine")
        alone = len(self.cluster.membership.ring) <= 1 if self.cluster else True
        if alone:  # the last node: everything is ours (scale to zero)
            n += await self.flusher.flush("all")
        secs = round(time.monotonic() - t0, 3)
        log.info("drained: %d entries written back in %.2fs", n, secs)
        return {"flushed": n, "seconds": secs}

    async def flush_all(self, prefix: str = "") -> None:
        if self.flusher is not None:
            if isinstance(self.fs, ClusterFilesystem):
                await self.fs.flush_open_files()
            await self.flusher.flush(prefix or "all")
        else:
            await self.writeback.flush(prefix)

    # -- control requests -----------------------------------------------------------------

    def _hit_ratio(self) -> float | None:
        reads = self.chunks.stats.hits + self.chunks.stats.misses
        return round(self.chunks.stats.hits / reads, 4) if reads else None

    def status(self) -> dict[str, Any]:
        c = self.chunks
        dirty_files, dirty_bytes, oldest_age = self.dirty_summary()
        return {
            "ok": True, "version": __version__, "pid": os.getpid(),
            "mountpoint": self.mountpoint,
            "source": f"s3://{self.cfg.bucket}/{self.cfg.prefix}".rstrip("/"),
            "endpoint": self.store.endpoint, "cache_dir": str(self.cache_dir.path),
            "uptime_seconds": round(time.time() - self.started, 1),
            "cache": {"used_bytes": c.used, "capacity_bytes": c.capacity,
                      "chunk_bytes": c.chunk_bytes, "local_file_bytes": c.local_bytes,
                      "chunks": c.chunk_count(), "hits": c.stats.hits,
                      "misses": c.stats.misses, "evictions": c.stats.evictions,
                      "uncached_reads": c.stats.bypass,
                      "bytes_read_from_cache": c.stats.bytes_from_cache,
                      "bytes_read_from_s3": c.stats.bytes_from_s3,
                      "bytes_read_from_peers": c.stats.bytes_from_peers,
                      "peer_fallbacks": c.stats.peer_fallbacks,
                      "bytes_served_to_peers": c.stats.bytes_served_to_peers,
                      "pinned_bytes": c.pinned_bytes,
                      "near_cache_bytes": c.near_bytes,
                      "near_cache_capacity_bytes": c.near_capacity if self.cluster else 0,
                      "hit_ratio": self._hit_ratio()},
            "dirty": {"files": dirty_files, "bytes": dirty_bytes,
                      "oldest_age_seconds": oldest_age},
            "writeback": dict(zip(("uploaded_files", "failed_uploads"),
                                  self.upload_counts(), strict=True)),
            "s3": self.store.stats.as_dict(),
            "cluster": self.cluster.status() if self.cluster else None,
        }

    def dirty_summary(self) -> tuple[int, int, float | None]:
        if self.flusher is not None:
            return self.flusher.dirty_summary()
        return self.local.dirty_summary()

    def upload_counts(self) -> tuple[int, int]:
        """(entries written back, write-backs that failed) by this node."""
        if self.flusher is not None:
            return self.flusher.uploaded, self.flusher.failed
        return self.writeback.uploaded_files, self.writeback.failed_uploads

    def node_stats(self) -> dict[str, Any]:
        """This node's row of the cluster-wide status (also served to peers)."""
        c = self.chunks
        dirty_files, dirty_bytes, oldest_age = self.dirty_summary()
        s3 = self.store.stats
        return {"cache_used_bytes": c.used, "cache_capacity_bytes": c.capacity,
                "pinned_bytes": c.pinned_bytes, "dirty_files": dirty_files,
                "dirty_bytes": dirty_bytes, "oldest_dirty_seconds": oldest_age,
                "hit_ratio": self._hit_ratio(),
                "s3_requests": sum(s3.requests.values()),
                "s3_errors": sum(s3.errors.values())}

    async def cluster_status(self) -> dict[str, Any]:
        assert self.cluster is not None
        st = self.cluster.status()
        replies = await self.cluster.broadcast({"op": "stats"})
        rows = {self.cluster.node_id: self.node_stats()}
        for node, reply in replies.items():
            stats = reply.get("stats") if reply else None
            rows[node] = stats if isinstance(stats, dict) else None
        for m in st["members"]:
            m["stats"] = rows.get(m["id"])
        st["raft"] = self.cluster.raft_status()
        return st

    async def handle_control(self, req: dict[str, Any], uid: int) -> dict[str, Any]:
        op = req.get("op")
        if op == "status":
            st = self.status()
            if self.cluster is not None:
                st["cluster"] = await self.cluster_status()
            return st
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
        if op == "flush":
            key = self.fs.key_of(int(req["ino"])) if "ino" in req else ""
            t0 = time.monotonic()
            await self.flush_all(key)
            return {"ok": True, "seconds": round(time.monotonic() - t0, 3)}
        if op == "drain":
            if self.flusher is None:
                raise UserError("drain is for cluster members (mounted with --listen); "
                                "use umount")
            result = await self.drain()
            self.unmount_requested = True
            trio.lowlevel.spawn_system_task(self._terminate_soon)
            return {"ok": True, "pid": os.getpid(), **result}
        if op == "unmount":
            if self.flusher is not None:
                await self.drain()
            else:
                await self.writeback.flush("")
            self.unmount_requested = True
            # Reply first; terminate once this request has been answered.
            trio.lowlevel.spawn_system_task(self._terminate_soon)
            return {"ok": True, "pid": os.getpid()}
        raise UserError(f"unknown control request {op!r}")

    # -- prefetch, pin, evict ---------------------------------------------------------------

    def resolve(self, ino: int) -> dict[str, Any]:
        """What a path (by inode number, which works through bind mounts) is in S3 terms."""
        inode = self.fs.inode(ino)
        is_dir = stat.S_ISDIR(inode.mode)
        return {"ok": True, "key": inode.key, "dir": is_dir, "size": inode.size,
                "etag": None if is_dir or self.local.by_key.get(inode.key) else inode.etag}

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
                if len(files) >= min(limit, 5000):
                    break
            else:
                last = None
        return {"ok": True, "files": files, "next": last}

    async def prefetch(self, files: list[Any], pin: bool) -> dict[str, Any]:
        """Warm (and pin) whole files: every chunk is fetched by its owner. Per file:
        [bytes fetched now, bytes that were cached already, error or None]."""
        refs: list[tuple[str, str, int, int]] = []
        spans: list[tuple[int, int]] = []
        cs = self.chunks.chunk_size
        for key, size, etag in files:
            first = len(refs)
            refs += [(str(key), str(etag), int(size), i) for i in range(-(-int(size) // cs))]
            spans.append((first, len(refs)))
        outcomes = await self.chunks.ensure_many(refs, pin)
        results: list[list[Any]] = []
        for (_, size, _), (a, b) in zip(files, spans, strict=True):
            fetched = cached = 0
            error = None
            for ref, outcome in zip(refs[a:b], outcomes[a:b], strict=True):
                n = self.chunks.chunk_len(int(size), ref[3])
                if outcome == "fetched":
                    fetched += n
                elif outcome == "cached":
                    cached += n
                else:
                    error = error or outcome
            self.prefetch_stats[0 if error is None else 1] += 1
            self.prefetch_stats[2] += fetched
            results.append([fetched, cached, error])
        return {"ok": True, "results": results}

    async def unpin_or_evict(self, op: str, prefix: str) -> dict[str, Any]:
        if op == "unpin":
            total, kept = self.chunks.unpin(prefix), 0
        else:
            total, kept = self.chunks.evict(prefix)
        unreachable = []
        if self.cluster is not None:
            for node, reply in (await self.cluster.broadcast({"op": op, "prefix": prefix})
                                ).items():
                if reply is None:
                    unreachable.append(node)
                    continue
                total += int(reply.get("bytes", 0))
                kept += int(reply.get("pinned_kept", 0))
        return {"ok": True, "bytes": total, "pinned_kept": kept, "unreachable": unreachable}

    async def _terminate_soon(self) -> None:
        await trio.sleep(0.05)
        pyfuse3.terminate()

    # -- running --------------------------------------------------------------------------

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("got %s: uploading dirty files, then unmounting",
                         signal.Signals(signum).name)
                try:
                    if self.flusher is not None:
                        await self.drain()
                    else:
                        await self.writeback.flush("")
                except ObjcacheError as e:
                    log.error("could not upload every dirty file before exit (they stay in "
                              "the cache dir and upload on the next mount): %s", e)
                self.unmount_requested = True
                pyfuse3.terminate()
                return

    async def _after_init(self) -> None:
        # The kernel resets the readahead window when FUSE's INIT completes, so raise it
        # only after a first request (a stat in a thread, answered by the loop) got through.
        await trio.to_thread.run_sync(os.stat, self.mountpoint)
        set_read_ahead(self.mountpoint)

    async def _main(self, ready: Any) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.chunks.run)
            await nursery.start(self.fs.run)
            if self.cluster is not None:
                # Join before mounting: a refused secret or a taken node id is a start-up
                # error, and nothing is mounted yet.
                await self.cluster.start(nursery)
            pyfuse3.init(self.ops, self.mountpoint, mount_options(self.cfg.allow_other))
            self._mounted = True
            if isinstance(self.fs, ClusterFilesystem):
                self.fs.notify = KernelNotifier()
            if self.flusher is not None:
                nursery.start_soon(self.flusher.run)
            else:
                nursery.start_soon(self.writeback.run)
            nursery.start_soon(self._signals)
            nursery.start_soon(self._after_init)
            ready()
            log.info("mounted s3://%s/%s at %s (cache %s, %d bytes)", self.cfg.bucket,
                     self.cfg.prefix, self.mountpoint, self.cache_dir.path,
                     self.cfg.cache_size)
            await pyfuse3.main()
            # The kernel side is gone (umount, fusermount -u, or terminate above): upload
            # what is still dirty while we still can, so "unmounted" means "in S3".
            try:
                with trio.move_on_after(3600):
                    if self.flusher is not None:
                        await self.drain()
                    else:
                        await self.writeback.flush("")
            except ObjcacheError as e:
                log.error("dirty files could not be uploaded before exit; they stay in the "
                          "cache dir and upload on the next mount: %s", e)
            if self.cluster is not None:
                await self.cluster.leave()
            nursery.cancel_scope.cancel()

    def run(self, ready: Any) -> None:
        self._mounted = False
        clean = False
        try:
            trio.run(self._main, ready)
            clean = True
        except BaseExceptionGroup as eg:
            err = unwrap(eg)
            if isinstance(err, UserError):  # e.g. the cluster refused our secret at start-up
                raise err from None
            raise
        finally:
            if self._mounted:
                pyfuse3.close(unmount=True)
            self.local.close()
            self.chunks.flush_atimes()
            self.db.close()
            log.info("unmounted %s%s", self.mountpoint, "" if clean else " after an error")
