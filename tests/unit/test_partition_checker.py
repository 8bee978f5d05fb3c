"""The partition checker's judgement of a register's final value (tests/helpers/partition.py,
`_allowed_final`), on crafted histories: the harness's verdicts are only as good as this."""

from __future__ import annotations

from tests.helpers.partition import Op, _allowed_final


def _write(wid: str, t0: float, t1: float, res: str) -> Op:
    return Op(0, "n0w0", "write", "reg/k0", t0, t1, res, wid)


def test_an_empty_register_needs_a_write_cut_short() -> None:
    acked = _write("a", 1.0, 2.0, "ok")
    assert _allowed_final("empty", [acked]) is not None
    assert _allowed_final("empty", [acked, _write("b", 3.0, float("inf"), "unfinished")]) is None


def test_a_write_cut_short_that_began_while_its_node_was_marked_down_counts() -> None:
    """Seeds 1175 and 1188: the killed worker's open(O_TRUNC) came as its node's mount came
    back, before the nemesis marked it up; the check renames such a result
    "unfinished+down", and the truncation its exit committed is allowed all the same."""
    history = [_write("a", 1.0, 2.0, "ok"), _write("b", 3.0, float("inf"), "unfinished+down")]
    assert _allowed_final("empty", history) is None
    assert _allowed_final("prefix:b:10", history) is None
    assert _allowed_final("prefix:a:10", history) is not None  # a was acknowledged whole


def test_failed_older_and_unknown_values_are_violations() -> None:
    history = [_write("a", 1.0, 2.0, "ok"), _write("b", 3.0, 4.0, "ok"),
               _write("c", 5.0, 6.0, "EIO")]
    assert _allowed_final("b", history) is None
    assert "older than acknowledged b" in (_allowed_final("a", history) or "")
    assert "answered EIO" in (_allowed_final("c", history) or "")
    assert "no write" in (_allowed_final("zzz", history) or "")
