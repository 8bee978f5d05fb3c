"""The environments the conformance suite runs in: the core over each backend, on an
in-memory store behind the fault-injecting wrapper (which injects nothing unless a test
asks). `env.a` and `env.b` are two nodes of a cluster, or the same node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from objcache.entries import FlushScope
from tests.helpers.inproc import FaultyStore, Posix, cluster, config, node
from tests.helpers.memstore import MemoryStore


@dataclass
class Env:
    kind: str
    a: Posix
    b: Posix
    store: FaultyStore

    @property
    def objects(self) -> dict[str, tuple[bytes, dict[str, str], str, int]]:
        """What S3 holds (key -> body, metadata, etag, mtime)."""
        return self.store.inner.objects

    def put(self, key: str, body: bytes, metadata: dict[str, str] | None = None) -> str:
        """An object written by another S3 client."""
        return self.store.inner.put(key, body, metadata)

    async def flush(self, key: str = "") -> int:
        return await self.a.fs.flush_scope(FlushScope.under(key))

    async def settle(self) -> None:
        """B catches up with what A committed. A stat or a name found on B may lag A by
        the milliseconds until B applies the change (an open, and a lookup that finds
        nothing, catch up first); the FUSE tests wait for it the same way."""
        await self.b.fs.sync()


@pytest.fixture(params=["local", "replicated"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    store = FaultyStore(MemoryStore())
    if request.param == "local":
        async with node(config(), store, tmp_path / "node") as p:
            yield Env("local", Posix(p.fs), Posix(p.fs), store)
    else:
        async with cluster(store, tmp_path, 2) as (p0, p1):
            yield Env("replicated", Posix(p0.fs), Posix(p1.fs), store)
