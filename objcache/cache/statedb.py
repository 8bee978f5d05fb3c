"""The cache directory's SQLite database: the chunk index and the write-back journal.

It is what lets a restarted daemon keep its cache and its dirty files. WAL mode with
synchronous=NORMAL makes every commit survive a `kill -9` of the daemon (the OS still has
the pages); the calls are short and made from the trio thread on purpose, so that a run
of statements between two awaits is atomic (as in S3QL).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
-- One row per clean object version with cached chunks: its file objects/XX/<id> holds
-- chunk idx at offset idx * chunk size (holes where a chunk is not cached).
CREATE TABLE IF NOT EXISTS objects (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    etag TEXT NOT NULL,
    size INTEGER NOT NULL,
    UNIQUE (key, etag)
);
-- One row per cached chunk of a clean object version: (key, etag, idx) names its bytes.
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    etag TEXT NOT NULL,
    idx INTEGER NOT NULL,
    size INTEGER NOT NULL,
    atime REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,  -- 1: kept until unpinned (prefetch --pin)
    sums BLOB,                  -- xxh3-64 of each 256 KiB block, verified on every read
    obj INTEGER,                -- the objects row whose file holds it
    UNIQUE (key, etag, idx)
);
-- One row per file whose data lives in a local file under local/ (new or modified files).
-- A file may be based on an S3 object version (base_key, base_etag): bytes below base_limit
-- in chunks not listed in `materialized` are still read from that version.
CREATE TABLE IF NOT EXISTS files (
    fid INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    base_key TEXT,
    base_etag TEXT,
    base_size INTEGER NOT NULL,
    base_limit INTEGER NOT NULL,
    materialized BLOB NOT NULL,
    size INTEGER NOT NULL,
    mode INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL DEFAULT 0,  -- 0: not known, shown as mtime
    ctime_ns INTEGER NOT NULL DEFAULT 0,
    dirty INTEGER NOT NULL,        -- 1 while the S3 object is not this file's content
    dirty_since REAL,              -- wall-clock time of the first unuploaded change
    etag TEXT                      -- the S3 ETag when clean
);
"""


class StateDB:
    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(_SCHEMA)
        cols = {row[1] for row in self.conn.execute("PRAGMA table_info(chunks)")}
        if "pinned" not in cols:  # a cache dir from before pinning existed
            self.conn.execute("ALTER TABLE chunks ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
        if "sums" not in cols:  # from before checksums: such chunks are fetched again
            self.conn.execute("ALTER TABLE chunks ADD COLUMN sums BLOB")
        if "obj" not in cols:  # from before object files (a file per chunk): fetched again
            self.conn.execute("ALTER TABLE chunks ADD COLUMN obj INTEGER")
        cols = {row[1] for row in self.conn.execute("PRAGMA table_info(files)")}
        for col in ("atime_ns", "ctime_ns"):  # from before atime and ctime were kept
            if col not in cols:
                self.conn.execute(f"ALTER TABLE files ADD COLUMN {col} INTEGER NOT NULL "
                                  "DEFAULT 0")
        row = self.conn.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
        if row is None:
            self.conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))

    def execute(self, sql: str, args: tuple[object, ...] = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        # The connection is in autocommit mode, where `with conn` opens no transaction:
        # without BEGIN every row would be its own commit.
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany(sql, rows)
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()
