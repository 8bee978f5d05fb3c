"""Nodes in this process, for driving the filesystem core without FUSE: the daemon's own
assembly (objcache.daemon.build) over an in-memory (optionally fault-injecting) store,
alone or as a cluster whose members are real Raft members and peers on 127.0.0.1. And a
path-based client that calls the core the way the kernel would."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from objcache.config import MountConfig
from objcache.core.filesystem import Filesystem
from objcache.core.inode import ROOT_INO, Attr
from objcache.daemon import Parts, build
from objcache.errors import NotFound, ObjcacheError, StoreRefused, StoreUnavailable
from objcache.store import get_small_each, head_each
from tests.helpers.cluster import free_port
from tests.helpers.memstore import MemoryStore

MiB = 1 << 20


@dataclass
class Fault:
    op: str
    skip: int  # calls of `op` that pass before this fault starts
    times: int  # calls it hits
    kind: str  # "fail" (raise `exc`), "stall" (sleep `seconds` first), "short" (body),
    # "lag" (answer what the store held at the call, `seconds` later)
    exc: type[ObjcacheError] = StoreUnavailable
    seconds: float = 0.0
    hits: int = 0


class FaultyStore:
    """An ObjectStore wrapper that fails, stalls or shortens chosen calls, the way the real
    store reports its failures to the layers above it (after its own retries): a failed
    call raises a domain error; a short body is a store that broke its contract."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.faults: list[Fault] = []
        self.calls: dict[str, int] = {}
        self.refused: set[str] = set()  # keys every write of is refused for good

    def refuse(self, key: str) -> None:
        """Writes of `key` fail as S3 fails them for a key it never accepts (a 4xx)."""
        self.refused.add(key)

    def _check_refused(self, key: str) -> None:
        if key in self.refused:
            raise StoreRefused(f"injected: S3 refuses {key!r} (AccessDenied)")

    def fail(self, op: str, times: int = 1, skip: int = 0,
             exc: type[ObjcacheError] = StoreUnavailable) -> None:
        self.faults.append(Fault(op, skip, times, "fail", exc))

    def stall(self, op: str, seconds: float, times: int = 1, skip: int = 0) -> None:
        self.faults.append(Fault(op, skip, times, "stall", seconds=seconds))

    def short(self, op: str, times: int = 1, skip: int = 0) -> None:
        """Bodies that end early: half arrives, then the call fails."""
        self.faults.append(Fault(op, skip, times, "short"))

    def lag(self, op: str, seconds: float, times: int = 1, skip: int = 0) -> None:
        """Answers that arrive `seconds` after the store read them (a LIST is what S3 held
        when it read it, whatever changed while the reply travelled)."""
        self.faults.append(Fault(op, skip, times, "lag", seconds=seconds))

    def clear(self) -> None:
        self.faults.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _lag(self, op: str) -> float:
        """The lag due for the next call of `op` (counted by `_before`)."""
        n = self.calls.get(op, 0)
        return sum(f.seconds for f in self.faults
                   if f.op == op and f.kind == "lag" and f.skip <= n and f.hits < f.times)

    async def _before(self, op: str) -> bool:
        """Apply the faults due for this call of `op`; whether its body is to be short."""
        n = self.calls.get(op, 0)
        self.calls[op] = n + 1
        short = False
        for f in self.faults:
            if f.op != op or n < f.skip or f.hits >= f.times:
                continue
            f.hits += 1
            if f.kind == "fail":
                raise f.exc(f"injected: {op} call {n + 1} fails")
            if f.kind == "stall":
                await trio.sleep(f.seconds)
            if f.kind == "short":
                short = True
        return short

    async def head(self, key: str) -> Any:
        await self._before("head")
        return await self.inner.head(key)

    async def head_many(self, keys: Sequence[str], each: Callable[[str, Any], None]) -> None:
        await head_each(self, keys, each)  # each HEAD meets the injected faults

    async def get_small_many(self, items: Sequence[tuple[str, int]],
                             each: Callable[[str, Any], None]) -> None:
        await get_small_each(self, items, each)  # each GET meets the injected faults

    def list_dir(self, prefix: str) -> AsyncIterator[Any]:
        return self._list_dir(prefix)

    async def _list_dir(self, prefix: str) -> AsyncIterator[Any]:
        lag = self._lag("list")
        await self._before("list")
        pages = [page async for page in self.inner.list_dir(prefix)]
        await trio.sleep(lag)
        for page in pages:
            yield page

    def list_recursive(self, prefix: str, start_after: str = "") -> AsyncIterator[Any]:
        return self._list_recursive(prefix, start_after)

    async def _list_recursive(self, prefix: str, start_after: str) -> AsyncIterator[Any]:
        await self._before("list")
        async for o in self.inner.list_recursive(prefix, start_after):
            yield o

    async def has_prefix(self, prefix: str) -> bool:
        await self._before("list")
        return await self.inner.has_prefix(prefix)

    async def get_into(self, key: str, etag: str | None, start: int, buf: memoryview,
                       progress: Any = None) -> None:
        short = await self._before("get")
        if short:  # half the body arrives, then the connection drops (after retries)
            data = await self.inner.get_range(key, etag, start, len(buf))
            half = len(data) // 2
            buf[:half] = data[:half]
            if progress is not None:
                progress(half)
            raise StoreUnavailable(f"injected: the body of {key!r} ended after {half} "
                                   f"of {len(data)} bytes")
        await self.inner.get_into(key, etag, start, buf, progress)

    async def get_range(self, key: str, etag: str | None, start: int, length: int) -> bytes:
        short = await self._before("get")
        data = await self.inner.get_range(key, etag, start, length)
        return data[:len(data) // 2] if short else data

    async def head_by_get(self, key: str, length: int, fd: int) -> Any:
        await self._before("get")
        return await self.inner.head_by_get(key, length, fd)

    async def put_bytes(self, key: str, body: bytes, metadata: dict[str, str]) -> str:
        self._check_refused(key)
        await self._before("put")
        return await self.inner.put_bytes(key, body, metadata)

    async def put_file(self, key: str, path: str, size: int, metadata: dict[str, str],
                       part_size: int, fence: Any = None) -> str:
        self._check_refused(key)
        await self._before("put")
        return await self.inner.put_file(key, path, size, metadata, part_size, fence)

    async def start_upload(self, key: str, metadata: dict[str, str]) -> str:
        self._check_refused(key)
        await self._before("put")
        return await self.inner.start_upload(key, metadata)

    async def put_part(self, key: str, upload_id: str, number: int, path: str, start: int,
                       length: int) -> str:
        await self._before("put")
        return await self.inner.put_part(key, upload_id, number, path, start, length)

    async def finish_upload(self, key: str, upload_id: str, etags: dict[int, str]) -> str:
        await self._before("put")
        return await self.inner.finish_upload(key, upload_id, etags)

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   src_etag: str | None = None) -> str:
        await self._before("copy")
        return await self.inner.copy(src, dst, metadata, src_etag)

    async def delete(self, key: str) -> None:
        await self._before("delete")
        await self.inner.delete(key)


def config(**kw: Any) -> MountConfig:
    cfg = MountConfig(bucket="conformance", chunk_size=MiB, cache_size=256 * MiB,
                      readahead=4 * MiB, writeback_delay=3600, metadata_ttl=30,
                      s3_retry_seconds=5, peer_timeout=3, txn_timeout=10)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@asynccontextmanager
async def node(cfg: MountConfig, store: Any, path: Path) -> AsyncIterator[Parts]:
    """One node, running until the block ends (then stopped without a drain: a crash)."""
    os.makedirs(path, exist_ok=True)
    parts = build(cfg, store, path, str(path / "mnt"), lambda: None)
    try:
        async with trio.open_nursery() as nursery:
            await parts.start(nursery)
            try:
                yield parts
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if parts.member is not None:
            parts.member.node.close()
        parts.close()


@asynccontextmanager
async def cluster(store: Any, root: Path, n: int = 2, **kw: Any
                  ) -> AsyncIterator[list[Parts]]:
    """`n` members forming one cluster and one Raft group."""
    secret = root / "cluster.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    parts: list[Parts] = []
    async with _nodes(store, root, addrs, str(secret), parts, kw):
        # One group with a leader that every member follows, before the tests start.
        with trio.fail_after(30):
            while True:
                rafts = [p.member.node.raft.status() for p in parts if p.member]
                # (and no member still handing over to its new voter: a test that holds
                # a voter's applied commands found a learner applying them)
                if (all(r is not None and len(r["members"]) == n and not r.get("promoting")
                        for r in rafts)
                        and len({r["leader"] for r in rafts}) == 1 and rafts[0]["leader"]
                        and all(p.member and p.member.node.raft.ready for p in parts)):
                    break
                await trio.sleep(0.05)
        yield parts


@asynccontextmanager
async def _nodes(store: Any, root: Path, addrs: list[str], secret: str, out: list[Parts],
                 kw: dict[str, Any]) -> AsyncIterator[None]:
    if len(out) == len(addrs):
        yield
        return
    i = len(out)
    cfg = config(listen=addrs[i], raft_port=free_port(), cluster_secret_file=secret,
                 peers=",".join(addrs[:i]) or None, node_id=f"n{i}", **kw)
    async with node(cfg, store, root / f"node{i}") as p:
        out.append(p)
        async with _nodes(store, root, addrs, secret, out, kw):
            yield


@dataclass
class Posix:
    """Path-based calls into a core, as the kernel makes them."""

    fs: Filesystem
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)

    async def ino(self, path: str) -> int:
        ino = ROOT_INO
        for name in [p for p in path.split("/") if p]:
            ino = (await self.fs.lookup(ino, name)).ino
        return ino

    async def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        return await self.ino(head), name

    async def stat(self, path: str) -> Attr:
        return await self.fs.getattr(await self.ino(path))

    async def exists(self, path: str) -> bool:
        try:
            await self.ino(path)
        except NotFound:
            return False
        return True

    async def create(self, path: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> int:
        pino, name = await self._parent(path)
        fh, _, _ = await self.fs.create(pino, name, mode, flags | os.O_CREAT, self.uid,
                                     self.gid)
        return fh

    async def open(self, path: str, flags: int = os.O_RDONLY) -> int:
        fh, _, _ = await self.fs.open(await self.ino(path), flags)
        return fh

    async def close(self, fh: int) -> None:
        await self.fs.flush(fh)
        await self.fs.release(fh)

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Like open(O_CREAT|O_TRUNC) + write + close."""
        if await self.exists(path):
            fh = await self.open(path, os.O_WRONLY | os.O_TRUNC)
        else:
            fh = await self.create(path, mode)
        if data:
            await self.fs.write(fh, 0, data)
        await self.close(fh)

    async def read(self, path: str) -> bytes:
        fh = await self.open(path)
        try:
            return await self.pread(fh, 0, 1 << 40)
        finally:
            await self.fs.release(fh)

    async def pread(self, fh: int, offset: int, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            piece = await self.fs.read(fh, offset + len(out), min(size - len(out), 8 * MiB))
            if not piece:
                break
            out += piece
        return bytes(out)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        pino, name = await self._parent(path)
        await self.fs.mkdir(pino, name, mode, self.uid, self.gid)

    async def rmdir(self, path: str) -> None:
        pino, name = await self._parent(path)
        await self.fs.rmdir(pino, name)

    async def unlink(self, path: str) -> None:
        pino, name = await self._parent(path)
        await self.fs.unlink(pino, name)

    async def rename(self, old: str, new: str, flags: int = 0) -> None:
        op, on = await self._parent(old)
        np, nn = await self._parent(new)
        await self.fs.rename(op, on, np, nn, flags)

    async def symlink(self, path: str, target: str) -> None:
        pino, name = await self._parent(path)
        await self.fs.symlink(pino, name, target.encode(), self.uid, self.gid)

    async def readlink(self, path: str) -> str:
        return (await self.fs.readlink(await self.ino(path))).decode()

    async def listdir(self, path: str) -> list[str]:
        return [name for name, _ in await self.fs.readdir(await self.ino(path))]

    async def truncate(self, path: str, size: int) -> None:
        await self.fs.setattr(await self.ino(path), size=size)

    async def chmod(self, path: str, mode: int) -> None:
        await self.fs.setattr(await self.ino(path), mode=mode)

    async def chown(self, path: str, uid: int, gid: int) -> None:
        await self.fs.setattr(await self.ino(path), uid=uid, gid=gid)

    async def utime(self, path: str, mtime: float) -> None:
        await self.fs.setattr(await self.ino(path), mtime_ns=int(mtime * 1e9))


def now() -> float:
    return time.time()
