"""What HEAD said about object versions: S3's user metadata (mode, owner, times, device
number, in s3fs's x-amz-meta-* convention), kept by (key, ETag, Last-Modified second).

S3 lists no metadata, so every file known from a LIST costs a HEAD before `ls -l` can
show it. But a LIST does tell each entry's ETag and Last-Modified, and a HEAD's answer
holds as long as both are unchanged: any write, and any metadata rewrite (a copy of the
object onto itself, which is how s3fs and objcache change a clean file's mode), gives the
object a new Last-Modified. So a listing whose versions match what is kept here needs no
HEAD at all: after a restart (the rows are in the state database) or, in a cluster, on
another node (objcache.cluster.metashare asks the key's owner).

The one change it cannot see is a metadata rewrite by another client within the same
second as the version it replaces, with the same ETag (documented in docs/semantics.md).

Rows are written in batches (a `kill -9` loses the last second's, which are HEADed again)
and the oldest written go when there are more than `max_rows`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Protocol

import trio

from objcache.cache.statedb import StateDB
from objcache.store import ObjectInfo
from objcache.ticks import sleep_ticks

MAX_ROWS = 2_000_000  # about 150 bytes each on disk
BATCH = 512  # rows buffered before a write
BATCH_SECONDS = 1.0  # or this long after the first buffered one
QUERY = 500  # keys per SELECT (SQLite allows 32,766 variables)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objmeta (
    key TEXT PRIMARY KEY,
    etag TEXT NOT NULL,
    modified INTEGER NOT NULL,  -- Last-Modified, in whole seconds (LIST and HEAD agree)
    meta TEXT NOT NULL          -- the x-amz-meta-* headers, as JSON
)
"""


def modified_s(info: ObjectInfo) -> int:
    return info.mtime_ns // 1_000_000_000


class ObjectMetaSource(Protocol):
    """Where the core looks up metadata of listed object versions before HEADing them."""

    async def lookup(self, objs: Sequence[ObjectInfo]) -> dict[str, dict[str, str]]:
        """Key -> metadata, for those of `objs` (versions from a LIST) it knows."""
        ...

    def remember(self, info: ObjectInfo) -> None:
        """What a HEAD (or GET) just said of a version (`info.metadata` is set)."""
        ...


class NoObjectMeta:
    """Nothing kept (the core driven on its own)."""

    async def lookup(self, objs: Sequence[ObjectInfo]) -> dict[str, dict[str, str]]:
        return {}

    def remember(self, info: ObjectInfo) -> None:
        pass


NO_OBJECT_META = NoObjectMeta()


class ObjectMeta:
    """This node's rows. Its calls are short SQLite statements on the trio thread, like
    the rest of the state database's (objcache.cache.statedb)."""

    def __init__(self, db: StateDB, max_rows: int = MAX_ROWS) -> None:
        self.db = db
        self.max_rows = max_rows
        db.execute(_SCHEMA)
        self._pending: dict[str, tuple[str, str, int, str]] = {}
        self._first_pending = 0.0
        self._written = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Write what was buffered at least every BATCH_SECONDS (a `kill -9` then loses
        at most that much)."""
        task_status.started()
        while True:
            await sleep_ticks(BATCH_SECONDS)
            self.flush()

    def get_many(self, versions: Sequence[tuple[str, str, int]]
                 ) -> dict[str, dict[str, str]]:
        """Key -> metadata for each (key, etag, modified second) known at that version."""
        self.flush()
        want = {k: (etag, mod) for k, etag, mod in versions}
        out: dict[str, dict[str, str]] = {}
        keys = list(want)
        for i in range(0, len(keys), QUERY):
            part = keys[i:i + QUERY]
            rows = self.db.execute(
                "SELECT key, etag, modified, meta FROM objmeta WHERE key IN "
                f"({','.join('?' * len(part))})", tuple(part)).fetchall()
            for key, etag, mod, meta in rows:
                if want.get(key) == (etag, mod):
                    try:
                        out[key] = dict(json.loads(meta))
                    except (ValueError, TypeError):
                        continue  # a damaged row: HEAD again
        return out

    async def lookup(self, objs: Sequence[ObjectInfo]) -> dict[str, dict[str, str]]:
        return self.get_many([(o.key, o.etag, modified_s(o)) for o in objs])

    def put(self, key: str, etag: str, modified: int, meta: dict[str, str]) -> None:
        if not self._pending:
            self._first_pending = time.monotonic()
        self._pending[key] = (key, etag, modified, json.dumps(meta, separators=(",", ":")))
        if (len(self._pending) >= BATCH
                or time.monotonic() - self._first_pending >= BATCH_SECONDS):
            self.flush()

    def remember(self, info: ObjectInfo) -> None:
        if info.metadata is not None:
            self.put(info.key, info.etag, modified_s(info), info.metadata)

    def flush(self) -> None:
        if not self._pending:
            return
        rows = list(self._pending.values())
        self._pending.clear()
        self.db.executemany("INSERT OR REPLACE INTO objmeta VALUES (?, ?, ?, ?)", rows)
        self._written += len(rows)
        if self._written >= self.max_rows // 10:
            self._written = 0
            self._trim()

    def _trim(self) -> None:
        (n,) = self.db.execute("SELECT COUNT(*) FROM objmeta").fetchone()
        if n > self.max_rows:
            self.db.execute("DELETE FROM objmeta WHERE rowid IN (SELECT rowid FROM objmeta "
                            "ORDER BY rowid LIMIT ?)", (n - self.max_rows,))
