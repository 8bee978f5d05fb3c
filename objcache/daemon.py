"""The mount daemon: the composition root. It checks the input, builds every component
(each gets its collaborators here, once), runs FUSE, and shuts down cleanly.

Start-up refuses bad input before anything is mounted (a missing bucket, wrong
credentials, an unreachable endpoint, a busy or non-empty mountpoint, a cache dir in use by
another daemon). SIGTERM and SIGINT behave like `objcache umount`: upload every dirty file
(in a cluster: drain), then unmount and exit; a Kubernetes preStop hook relies on that.
What the control requests do is objcache.admin's; what status reports, objcache.status's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from objcache.admin import ControlHandlers
from objcache.backend.base import Backend
from objcache.backend.local import LocalBackend
from objcache.backend.replicated import ReplicatedBackend, applied_changes
from objcache.cache.chunks import ChunkCache
from objcache.cache.localfiles import LocalFiles
from objcache.cache.objmeta import ObjectMeta
from objcache.cache.pins import Pins
from objcache.cache.quarantine import Quarantine
from objcache.cache.router import ChunkRouter
from objcache.cache.statedb import StateDB
from objcache.cluster.chunkservice import ChunkService
from objcache.cluster.metashare import SharedObjectMeta
from objcache.cluster.node import ClusterNode, bind_listener, load_secret, raft_address
from objcache.cluster.peers import PeerServer, Routes
from objcache.config import MountConfig, parse_log_level, startup_warnings
from objcache.control import ControlChannel
from objcache.core.filesystem import Filesystem
from objcache.core.passthrough import Passthrough
from objcache.errors import ObjcacheError, StoreRefused, UserError, unwrap
from objcache.fs import watchdog
from objcache.fs.kernel import FuseSession
from objcache.fs.mounting import mount_device
from objcache.fs.operations import (
    FuseReport,
    KernelNotifier,
    Operations,
    SessionBacking,
    mount_options,
)
from objcache.status import ClusterStatus, MemberStatus, NoCluster, NodeRow, NodeStatus
from objcache.store import ObjectStore
from objcache.store.s3 import S3Store
from objcache.txn.coordinator import TxnClient
from objcache.txn.dirtystore import DirtyStore
from objcache.txn.state import ClusterState

log = logging.getLogger(__name__)


_SECRET_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")


def setup_logging(level: str, log_file: str | None) -> None:
    handler: logging.Handler = (logging.FileHandler(log_file) if log_file
                                else logging.StreamHandler(sys.stderr))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
        "%Y-%m-%d %H:%M:%S"))
    root_level, named = parse_log_level(level)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(root_level.upper())
    # botocore at DEBUG prints request headers (signatures, tokens): never let it, not
    # even when a level is named for it.
    for noisy in _SECRET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, lvl in named.items():
        if name.split(".")[0] not in _SECRET_LOGGERS:
            logging.getLogger(name).setLevel(lvl.upper())


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


class Member:
    """What only a cluster member has: its node, its peer socket and server."""

    def __init__(self, node: ClusterNode, sock: socket.socket, server: PeerServer) -> None:
        self.node = node
        self.sock = sock
        self.server = server


@dataclass
class Parts:
    """One node's components, built by `build` (lowest layer first)."""

    cfg: MountConfig
    store: ObjectStore
    db: StateDB
    cache: ChunkCache
    pins: Pins
    router: ChunkRouter
    local: LocalFiles
    backend: Backend
    own_meta: ObjectMeta
    meta: ObjectMeta | SharedObjectMeta
    session: FuseSession
    notifier: KernelNotifier
    fs: Filesystem
    status: NodeStatus
    control: ControlChannel
    member: Member | None

    async def start(self, nursery: trio.Nursery) -> None:
        """The background work, then (a member) joining the cluster: a refused secret or
        a taken node id fails here, before anything is mounted."""
        await nursery.start(self.cache.run)
        await nursery.start(self.own_meta.run)
        await nursery.start(self.fs.run)
        if self.member is not None:
            m = self.member
            await m.node.start(nursery, m.sock, m.server)
        if isinstance(self.meta, SharedObjectMeta):
            await nursery.start(self.meta.run)
        await nursery.start(self.backend.run)

    async def stop(self) -> None:
        """Upload what is dirty (a member: what it owns or holds), then leave."""
        # Now, not only in close(): a SIGTERM that comes after the event loop ended (a
        # lazy unmount, then TERM) ends the process before close() runs.
        self.own_meta.flush()
        try:
            await self.fs.drain()
        except ObjcacheError as e:
            log.error("could not upload every dirty file before exit (they stay in the "
                      "cache dir and upload on the next mount): %s", e)
        if self.member is not None:
            await self.member.node.leave()

    def close(self) -> None:
        self.own_meta.flush()
        self.local.close()
        self.cache.flush_atimes()
        self.db.close()


def build(cfg: MountConfig, store: ObjectStore, path: Path, mountpoint: str,
          leave: Callable[[], None]) -> Parts:
    """Every component of a node, each given its collaborators once: a single node, or
    (with cfg.listen) a cluster member. `leave` is what `umount`/`drain` requests do once
    answered."""
    db = StateDB(path / "state.db")
    session = FuseSession(mountpoint, mount_options(cfg.allow_other),
                          passthrough=not cfg.no_passthrough)
    passthrough = Passthrough(SessionBacking(session))
    # Download buffers: the readahead window, the chunk being read, one spare.
    cache = ChunkCache(db, path, cfg.cache_size, cfg.chunk_size, store,
                       near_capacity=cfg.near_cache_size or 0,
                       buffers=max(1, cfg.readahead // cfg.chunk_size) + 2,
                       file_gone=passthrough.forget)
    node: ClusterNode | None = None
    if cfg.listen:
        key = load_secret(cfg.cluster_secret_file)
        bind_listener(raft_address(cfg)).close()  # a taken Raft port fails here, clearly
        sock = bind_listener(cfg.listen)
        node = ClusterNode(cfg, key, cache, cfg.chunk_size, path / "raft", ClusterState,
                           applied_changes)
        pins = Pins(cache, node.placement)
        router = ChunkRouter(cache, pins, node.placement)
    else:
        pins = Pins(cache)
        router = ChunkRouter(cache, pins)
    local = LocalFiles(db, path, cache, router, wait_budget=cfg.s3_retry_seconds)
    quarantine = Quarantine(path)
    backend: Backend
    if node is not None:
        _discard_unclosed(local)
        dirty = DirtyStore(path, cache.charge, cache.release)
        txn = TxnClient(node, dirty, cfg.replicas, cfg.txn_timeout)
        backend = ReplicatedBackend(cfg, store, txn, dirty, local, node.raft.applied,
                                    quarantine)
    else:
        backend = LocalBackend(cfg, store, local, quarantine)
    own_meta = ObjectMeta(db)
    meta: ObjectMeta | SharedObjectMeta = own_meta
    if node is not None:
        meta = SharedObjectMeta(own_meta, node.membership, node.client, cfg.peer_timeout)
    notifier = KernelNotifier(session)
    fs = Filesystem(cfg, backend, router, local, notifier, meta, passthrough)
    rows = NodeRow(store, cache, backend)
    cluster: ClusterStatus = NoCluster()
    member = None
    if node is not None:
        server = PeerServer(node.key, Routes({
            **node.routes(), **ChunkService(router, pins).routes(), **txn.routes(),
            **meta.routes(), "stats": rows.serve}))
        member = Member(node, sock, server)
        cluster = MemberStatus(node, server)
    status = NodeStatus(cfg, mountpoint, str(path), rows, cluster, FuseReport(session, fs))
    control = ControlChannel(ControlHandlers(fs, store, router, pins, status, cluster, leave))
    return Parts(cfg, store, db, cache, pins, router, local, backend, own_meta, meta,
                 session, notifier, fs, status, control, member)


def _discard_unclosed(local: LocalFiles) -> None:
    """In a cluster a file is committed at close(); working copies left by a crash were
    never closed (never acknowledged): they go, like unsynced writes."""
    n = 0
    for lf in list(local.by_key.values()):
        if lf.dirty:
            n += 1
        local.remove(lf)
    if n:
        log.warning("discarded %d files that were open for writing when the previous "
                    "daemon died (never closed, so never committed)", n)


class Daemon:
    def __init__(self, cfg: MountConfig) -> None:
        self.cfg = cfg
        # Resolved now: once mounted, resolving it would stat our own mount.
        self.mountpoint = os.path.realpath(cfg.mountpoint)
        self._mounted = False

    def prepare(self) -> None:
        """Everything that can fail because of user input, before mounting; then build."""
        cfg = self.cfg
        for warning in startup_warnings(cfg):
            log.warning("%s", warning)
        # Every cached chunk file, peer and client connection is a descriptor: take what
        # the hard limit allows (often 1,024 soft against 2^20 hard).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        check_mountpoint(self.mountpoint, cfg.recover_mount)
        self.store = store = S3Store(cfg.bucket, cfg.prefix, cfg.endpoint_url, cfg.region,
                                     cfg.s3_concurrency, cfg.s3_retry_seconds,
                                     sign_payload=cfg.sign_payload)
        store.check_bucket()
        self.cache_dir = CacheDir(cfg)
        self.parts = build(cfg, store, self.cache_dir.path, self.mountpoint,
                           self._request_unmount)
        if cfg.metrics_addr:
            from objcache import metrics
            self.metrics_server = metrics.serve(cfg.metrics_addr, self.parts.status.snapshot)
        self.ops = Operations(self.parts.fs, self.parts.control, self.parts.notifier)

    def _request_unmount(self) -> None:
        """Unmount and exit once the control request that asked has been answered."""
        trio.lowlevel.spawn_system_task(self._terminate_soon)

    async def _terminate_soon(self) -> None:
        await trio.sleep(0.05)
        self.parts.session.terminate()

    # -- running --------------------------------------------------------------------------

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("got %s: uploading dirty files, then unmounting",
                         signal.Signals(signum).name)
                try:
                    await self.parts.fs.drain()
                except StoreRefused as e:
                    log.error("unmounting; %s", e)
                except ObjcacheError as e:
                    log.error("could not upload every dirty file before exit (they stay in "
                              "the cache dir and upload on the next mount): %s", e)
                self.parts.session.terminate()
                return

    async def _main(self, ready: Any) -> None:
        parts = self.parts
        async with trio.open_nursery() as nursery:
            await parts.start(nursery)
            parts.session.mount()
            self._mounted = True
            dev = mount_device(self.mountpoint)
            if dev is not None:  # (from this, the main thread: its exit arms the watchdog)
                watchdog.start(self.mountpoint, dev)
            nursery.start_soon(self._signals)
            ready()
            log.info("mounted s3://%s/%s at %s (cache %s, %d bytes)", self.cfg.bucket,
                     self.cfg.prefix, self.mountpoint, self.cache_dir.path,
                     self.cfg.cache_size)
            await parts.session.serve(self.ops)
            # The kernel side is gone (umount, fusermount -u, or terminate above): upload
            # what is still dirty while we still can, so "unmounted" means "in S3".
            with trio.move_on_after(3600):
                await parts.stop()
            nursery.cancel_scope.cancel()

    def run(self, ready: Any) -> None:
        clean = False

        def finishing(signum: int, _frame: object) -> None:
            log.info("got %s while finishing: the uploads and the unmount go on",
                     signal.Signals(signum).name)

        # Outside the signal receiver's life (before it opens, once it has answered a
        # first signal, after the event loop): a TERM or INT must not end the process
        # mid-upload or before close() writes the journal and metadata out.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, finishing)
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
                self.parts.session.close(unmount_it=True)
            self.parts.close()
            self.store.close()
            log.info("unmounted %s%s", self.mountpoint, "" if clean else " after an error")
