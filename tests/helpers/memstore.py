"""An in-memory ObjectStore for fast unit tests (never the only proof of a feature)."""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import trio
import trio.lowlevel

from objcache.errors import StaleObject
from objcache.store import ListPage, ObjectInfo, get_small_each, head_each


class MemoryStore:
    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, dict[str, str], str, int]] = {}
        self.calls: Counter[str] = Counter()
        self.delay = 0.0
        self.uploads: dict[str, tuple[str, dict[str, str], dict[int, bytes]]] = {}
        self.aborted = 0

    def put(self, key: str, body: bytes, metadata: dict[str, str] | None = None) -> str:
        etag = '"' + hashlib.md5(body).hexdigest() + '"'
        self.objects[key] = (body, dict(metadata or {}), etag, time.time_ns())
        return etag

    def _info(self, key: str, with_meta: bool) -> ObjectInfo:
        body, meta, etag, mtime = self.objects[key]
        return ObjectInfo(key, len(body), etag, mtime, dict(meta) if with_meta else None)

    async def head_many(self, keys: Sequence[str],
                        each: Callable[[str, ObjectInfo | None | Exception], None]) -> None:
        await head_each(self, keys, each)

    async def get_small_many(self, items: Sequence[tuple[str, int]],
                             each: Callable[[str, tuple[ObjectInfo, bytes] | None | Exception],
                                            None]) -> None:
        await get_small_each(self, items, each)

    async def head(self, key: str) -> ObjectInfo | None:
        self.calls["head"] += 1
        await trio.lowlevel.checkpoint()
        return self._info(key, True) if key in self.objects else None

    async def list_dir(self, prefix: str) -> AsyncIterator[ListPage]:
        self.calls["list"] += 1
        objs, prefixes = [], set()
        for key in sorted(self.objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if "/" in rest:
                prefixes.add(prefix + rest.split("/")[0] + "/")
            else:
                objs.append(self._info(key, False))
        yield ListPage(objs, sorted(prefixes))

    async def list_recursive(self, prefix: str, start_after: str = ""
                             ) -> AsyncIterator[ObjectInfo]:
        for key in sorted(self.objects):
            if key.startswith(prefix) and key > start_after:
                yield self._info(key, False)

    async def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.objects)

    def _check(self, key: str, etag: str | None) -> bytes:
        body, _, cur, _ = self.objects[key]
        if etag is not None and etag != cur:
            raise StaleObject(key)
        return body

    async def get_into(self, key: str, etag: str | None, start: int, buf: memoryview,
                       progress: Callable[[int], None] | None = None) -> None:
        self.calls["get"] += 1
        await trio.sleep(self.delay)
        data = self._check(key, etag)[start:start + len(buf)]
        buf[:len(data)] = data
        if progress is not None:
            progress(len(data))

    async def get_range(self, key: str, etag: str | None, start: int, length: int) -> bytes:
        self.calls["get"] += 1
        await trio.sleep(self.delay)
        return self._check(key, etag)[start:start + length]

    async def head_by_get(self, key: str, length: int, fd: int
                          ) -> tuple[ObjectInfo, int] | None:
        self.calls["get"] += 1
        await trio.sleep(self.delay)
        if key not in self.objects:
            return None
        data = self.objects[key][0][:length]
        os.pwrite(fd, data, 0)
        return self._info(key, True), len(data)

    async def put_bytes(self, key: str, body: bytes, metadata: dict[str, str]) -> str:
        self.calls["put"] += 1
        return self.put(key, body, metadata)

    async def put_file(self, key: str, path: str, size: int, metadata: dict[str, str],
                       part_size: int, fence: Callable[[], Awaitable[None]] | None = None
                       ) -> str:
        self.calls["put"] += 1
        data = await trio.Path(path).read_bytes()
        await trio.sleep(self.delay)
        if fence is not None:
            await fence()
        return self.put(key, data.ljust(size, b"\0"), metadata)

    async def start_upload(self, key: str, metadata: dict[str, str]) -> str:
        self.calls["create_multipart"] += 1
        upload_id = os.urandom(8).hex()
        self.uploads[upload_id] = (key, dict(metadata), {})
        return upload_id

    async def put_part(self, key: str, upload_id: str, number: int, path: str, start: int,
                       length: int) -> str:
        self.calls["upload_part"] += 1
        await trio.sleep(self.delay)
        whole = await trio.Path(path).read_bytes()
        data = whole[start:start + length].ljust(length, b"\0")
        self.uploads[upload_id][2][number] = data
        return '"' + hashlib.md5(data).hexdigest() + '"'

    async def finish_upload(self, key: str, upload_id: str, etags: dict[int, str]) -> str:
        self.calls["complete_multipart"] += 1
        k, meta, parts = self.uploads.pop(upload_id)
        assert k == key and sorted(parts) == sorted(etags) == list(range(1, len(etags) + 1))
        return self.put(key, b"".join(parts[n] for n in sorted(parts)), meta)

    async def abort_upload(self, key: str, upload_id: str) -> None:
        self.aborted += 1
        self.uploads.pop(upload_id, None)

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   src_etag: str | None = None) -> str:
        body, meta, etag, _ = self.objects[src]
        if src_etag is not None and etag != src_etag:
            raise StaleObject(src)
        return self.put(dst, body, meta if metadata is None else metadata)

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)
