"""Pulling a blob from a holder (objcache/txn/dirtystore.py): a holder that fails midway
fails the pull with its own error, leaves no partial blob, and the next pull works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objcache.errors import PeerError
from objcache.txn.dirtystore import DirtyStore


async def test_a_failed_pull_raises_the_holders_error_and_leaves_nothing(tmp_path: Path
                                                                         ) -> None:
    ds = DirtyStore(tmp_path, lambda n: True, lambda n: None)
    data = os.urandom(3 << 20)

    async def failing(off: int, view: memoryview) -> None:
        part = view[:16]  # a view of the pull's buffer, still referenced by the traceback
        part[:] = data[off:off + 16]
        raise PeerError("the holder went away")

    with pytest.raises(PeerError, match="went away"):
        await ds.pull("c0ffee", len(data), failing)
    assert not ds.has("c0ffee")
    assert [p.name for p in ds.root.iterdir()] == []

    async def good(off: int, view: memoryview) -> None:
        view[:] = data[off:off + len(view)]

    await ds.pull("c0ffee", len(data), good)
    assert ds.has("c0ffee")
    assert await trio.Path(ds.path("c0ffee")).read_bytes() == data
