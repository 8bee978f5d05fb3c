"""The quarantine's count of what a flush quarantined (objcache/cache/quarantine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from objcache.cache.quarantine import Quarantine
from objcache.errors import StoreRefused


async def test_a_flush_counts_its_quarantine_after_a_hundred_before_it(tmp_path: Path
                                                                       ) -> None:
    """`recent` keeps the last 100: a flush that took its length as its starting point
    found nothing new once it held 100 (the new one pushed the oldest out), and passed
    with a file quarantined."""
    q = Quarantine(tmp_path)

    async def drop() -> None:
        pass

    for i in range(100):
        await q.put(f"old{i}", None, 0, "refused", drop)
    since = q.count
    q.raise_if_refused(since, lambda k: True)  # nothing since
    await q.put("new", None, 0, "refused", drop)
    with pytest.raises(StoreRefused, match="'new'") as e:
        q.raise_if_refused(since, lambda k: True)
    assert "old" not in str(e.value)
    q.raise_if_refused(since, lambda k: k != "new")  # out of the flush's scope
    assert len(q.recent) == 100 and q.count == 101
