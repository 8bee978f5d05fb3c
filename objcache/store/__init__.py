"""The object-store interface the filesystem core is written against.

Keys are relative to the mount's prefix and use '/' as the separator; a directory marker
is the directory's key plus '/'. Implementations: `s3.S3Store` (boto3) and
`memory.MemoryStore` (unit tests).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

# Awaited right before an upload becomes visible (see ObjectStore.put_file).
Fence = Callable[[], Awaitable[None]]
# One answer of `head_many`: what `head` returns, or the error it would raise.


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What S3 says about one object. `metadata` is None when it came from a LIST."""

    key: str
    size: int
    etag: str
    mtime_ns: int
    metadata: dict[str, str] | None = None


@dataclass(slots=True)
class ListPage:
    objects: list[ObjectInfo]
    prefixes: list[str]


class ObjectStore(Protocol):
    async def head(self, key: str) -> ObjectInfo | None: ...

    async def head_many(self, keys: Sequence[str],
                        each: Callable[[str, ObjectInfo | None | Exception], None]) -> None:
        """`head` of every key, as many at once as the store can; `each(key, answer)`
        as answers come: what `head` returns, or the error it would raise (a failure is
        not retried: the caller asks again with `head` if it must know)."""
        ...

    def list_dir(self, prefix: str) -> AsyncIterator[ListPage]:
        """One level below `prefix` (which is '' or ends with '/'), page by page."""
        ...

    def list_recursive(self, prefix: str, start_after: str = "") -> AsyncIterator[ObjectInfo]:
        """Every key under `prefix` (after `start_after`, if given), in key order."""
        ...

    async def has_prefix(self, prefix: str) -> bool:
        """True when at least one key starts with `prefix`."""
        ...

    async def get_range(self, key: str, etag: str | None, start: int, length: int) -> bytes: ...

    async def get_into(self, key: str, etag: str | None, start: int, buf: memoryview,
                       progress: Callable[[int], None] | None = None) -> None:
        """Bytes [start, start+len(buf)) into `buf` as they arrive; `progress(n)` (maybe
        from another thread) says how many from the front of `buf` are in. Raises
        StaleObject when the object's ETag is no longer `etag`."""
        ...

    async def head_by_get(self, key: str, length: int, fd: int
                          ) -> tuple[ObjectInfo, int] | None:
        """What `head` says, from a GET of the first `length` bytes, which are written to
        `fd` at 0; also how many were. None if there is no such object."""
        ...

    async def get_small_many(
            self, items: Sequence[tuple[str, int]],
            each: Callable[[str, tuple[ObjectInfo, bytes] | None | Exception], None]) -> None:
        """`head_by_get` of every (key, length) at once, the bytes handed over instead of
        written: `each(key, (info, first bytes))`, None when there is no such object, or
        the error (not retried), as `head_many` answers."""
        ...

    async def put_bytes(self, key: str, body: bytes, metadata: dict[str, str]) -> str: ...

    async def put_file(self, key: str, path: str, size: int, metadata: dict[str, str],
                       part_size: int, fence: Fence | None = None) -> str:
        """Upload a local file (multipart with `part_size` parts when larger); return ETag.
        `fence` is awaited right before the one call that makes the object visible (the
        PUT, or the completion of the multipart upload); what it raises aborts."""
        ...

    async def start_upload(self, key: str, metadata: dict[str, str]) -> str:
        """Begin a multipart upload of `key`; its upload id."""
        ...

    async def put_part(self, key: str, upload_id: str, number: int, path: str, start: int,
                       length: int) -> str:
        """Bytes [start, start+length) of the file at `path` as part `number`; its ETag."""
        ...

    async def finish_upload(self, key: str, upload_id: str, etags: dict[int, str]) -> str:
        """Complete the upload from its parts (number -> ETag); the object's ETag."""
        ...

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts (best effort, never raises)."""
        ...

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   src_etag: str | None = None) -> str:
        """Server-side copy; `metadata` replaces the metadata when given; with `src_etag`,
        StaleObject if the source is no longer that version. Returns the ETag."""
        ...

    async def delete(self, key: str) -> None: ...


async def head_each(store: ObjectStore, keys: Sequence[str],
                    each: Callable[[str, ObjectInfo | None | Exception], None],
                    at_once: int = 16) -> None:
    """`head_many` by one `head` per key, `at_once` at a time: for stores with no batch
    path of their own."""
    limiter = trio.CapacityLimiter(at_once)

    async def one(key: str) -> None:
        async with limiter:
            try:
                answer: ObjectInfo | None | Exception = await store.head(key)
            except Exception as e:  # handed to the caller, who decides
                answer = e
        each(key, answer)

    async with trio.open_nursery() as n:
        for key in keys:
            n.start_soon(one, key)


async def get_small_each(store: ObjectStore, items: Sequence[tuple[str, int]],
                         each: Callable[[str, tuple[ObjectInfo, bytes] | None | Exception],
                                        None],
                         at_once: int = 16) -> None:
    """`get_small_many` by one `head_by_get` per key (into an in-memory file), `at_once` at
    a time: for stores with no batch path of their own."""
    limiter = trio.CapacityLimiter(at_once)

    async def one(key: str, length: int) -> None:
        async with limiter:
            fd = os.memfd_create("objcache-small")
            try:
                got = await store.head_by_get(key, length, fd)
                answer: tuple[ObjectInfo, bytes] | None | Exception = (
                    None if got is None else (got[0], os.pread(fd, got[1], 0)))
            except Exception as e:  # handed to the caller, who decides
                answer = e
            finally:
                os.close(fd)
        each(key, answer)

    async with trio.open_nursery() as n:
        for key, length in items:
            n.start_soon(one, key, length)
