"""A member killed during a log compaction keeps every entry it had: pysyncobj replaces
the dump, then drops the journal's entries the dump covers; a member stopped between the
two came back with a journal that does not start where the dump ends, and pysyncobj
emptied it, losing the entries after the dump (objcache/raft/node.py). One real voter in
this process, alone in its group."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from objcache.raft.node import RaftNode, _Replica
from tests.helpers.cluster import free_port
from tests.helpers.raftlog import Log, submit_once_led

COMPACT = 20


def _entries(path: Path) -> list[int]:
    from pysyncobj.journal import FileJournal

    j = FileJournal(str(path))
    try:
        return [j[i][1] for i in range(len(j))]
    finally:
        j._destroy()


async def _submit(node: RaftNode, names: range) -> None:
    """In batches, in order (each batch is one or a few log entries)."""
    for start in range(0, len(names), 5):
        async with trio.open_nursery() as n:
            for i in names[start:start + 5]:
                n.start_soon(submit_once_led, node, f"c{i}", 20)


async def test_a_compaction_keeps_what_follows_the_dump_across_restarts(tmp_path: Path
                                                                       ) -> None:
    addr = f"127.0.0.1:{free_port()}"
    node = RaftNode(addr, [addr], tmp_path, "k" * 32, Log(), compact_entries=COMPACT)
    try:
        await _submit(node, range(3 * COMPACT))
        assert sorted(node.state.seen) == sorted(f"c{i}" for i in range(3 * COMPACT))
    finally:
        node.destroy_synchronous()
    kept = _entries(tmp_path / "raft.journal")
    assert len(kept) <= COMPACT + 2 and kept == list(range(kept[0], kept[0] + len(kept)))
    assert not (tmp_path / "raft.journal.compacting").exists()

    again = RaftNode(addr, [addr], tmp_path, "k" * 32, Log(), compact_entries=COMPACT)
    try:
        await submit_once_led(again, "after", 20)
        assert sorted(again.state.seen) == sorted([*(f"c{i}" for i in range(3 * COMPACT)),
                                                   "after"])
    finally:
        again.destroy_synchronous()


async def test_a_member_stopped_between_the_dump_and_the_journal_cut_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    addr = f"127.0.0.1:{free_port()}"
    # The dump is replaced, the journal is never cut: as if stopped in between, every time.
    monkeypatch.setattr(_Replica, "_SyncObj__deleteEntriesTo", lambda self, to: None)
    node = RaftNode(addr, [addr], tmp_path, "k" * 32, Log(), compact_entries=COMPACT)
    try:
        await _submit(node, range(2 * COMPACT + 7))
    finally:
        node.destroy_synchronous()
    assert (tmp_path / "raft.dump").exists()
    whole = _entries(tmp_path / "raft.journal")
    assert whole[0] == 1 and len(whole) > COMPACT + 2  # the journal was never cut
    monkeypatch.undo()

    caplog.set_level(logging.INFO, "objcache.raft.node")
    again = RaftNode(addr, [addr], tmp_path, "k" * 32, Log(), compact_entries=COMPACT)
    try:
        await submit_once_led(again, "after", 20)
        assert sorted(again.state.seen) == sorted([*(f"c{i}" for i in range(2 * COMPACT + 7)),
                                                   "after"])
    finally:
        again.destroy_synchronous()
    assert "our dump ends at index" in caplog.text
    assert _entries(tmp_path / "raft.journal")[0] > 1
