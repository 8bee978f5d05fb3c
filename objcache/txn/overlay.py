"""The bucket as the cluster sees it: S3 minus what the namespace overlay has deleted.

A tombstone hides an S3 object from lookups and listings from the moment its unlink or
rename commits, on every node, although the object itself is deleted later (by its
owner, at write-back). Reads of object data are not filtered: a renamed file's entry still
reads its old object until write-back has copied it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from objcache.entries import Tombstone
from objcache.store import ListPage, ObjectInfo, ObjectStore

if TYPE_CHECKING:
    from objcache.txn.coordinator import TxnClient


class OverlayStore:
    def __init__(self, store: ObjectStore, txn: TxnClient) -> None:
        self.store = store
        self.txn = txn

    def __getattr__(self, name: str) -> Any:  # data and write calls pass straight through
        return getattr(self.store, name)

    def _tombstoned(self, key: str) -> bool:
        st = self.txn.state
        with st.lock:
            return isinstance(st.ns.get(key), Tombstone)

    def _tombs_under(self, prefix: str) -> bool:
        st = self.txn.state
        with st.lock:
            return any(isinstance(e, Tombstone) for _, e in st.ns.under(prefix))

    async def head(self, key: str) -> ObjectInfo | None:
        if self._tombstoned(key):
            return None
        return await self.store.head(key)

    async def head_many(self, keys: Sequence[str],
                        each: Callable[[str, ObjectInfo | None | Exception], None]) -> None:
        ask = []
        for key in keys:
            if self._tombstoned(key):
                each(key, None)
            else:
                ask.append(key)
        if ask:
            await self.store.head_many(ask, each)

    async def get_small_many(
            self, items: Sequence[tuple[str, int]],
            each: Callable[[str, tuple[ObjectInfo, bytes] | None | Exception], None]) -> None:
        ask = []
        for key, length in items:
            if self._tombstoned(key):
                each(key, None)
            else:
                ask.append((key, length))
        if ask:
            await self.store.get_small_many(ask, each)

    async def head_by_get(self, key: str, length: int, fd: int
                          ) -> tuple[ObjectInfo, int] | None:
        if self._tombstoned(key):
            return None
        return await self.store.head_by_get(key, length, fd)

    async def has_prefix(self, prefix: str) -> bool:
        if not self._tombs_under(prefix):
            return await self.store.has_prefix(prefix)
        async for _ in self.list_recursive(prefix):
            return True
        return False

    async def list_recursive(self, prefix: str, start_after: str = ""
                             ) -> AsyncIterator[ObjectInfo]:
        async for o in self.store.list_recursive(prefix, start_after):
            if not self._tombstoned(o.key):
                yield o

    async def list_dir(self, prefix: str) -> AsyncIterator[ListPage]:
        async for page in self.store.list_dir(prefix):
            objects = [o for o in page.objects if not self._tombstoned(o.key)]
            prefixes = [p for p in page.prefixes
                        if not self._tombs_under(p) or await self.has_prefix(p)]
            yield ListPage(objects, prefixes)
