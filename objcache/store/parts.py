"""The multipart part schedule: which byte ranges become which S3 part numbers.

S3 allows 10,000 parts per upload, each at least 5 MiB except the last. Parts start at the
chunk size and double every 1,000 parts, so the schedule does not depend on the final size
(a streaming upload starts before the size is known) and 10,000 parts cover about 5 TiB with
5 MiB parts and 16 TiB with 16 MiB parts (no part above S3's 5 GiB).
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_PARTS = 10_000
MIN_PART = 5 << 20
MAX_PART = 5 << 30
GROW_EVERY = 1_000


def part_size(base: int, number: int) -> int:
    """Size of part `number` (1-based) when parts start at `base` bytes."""
    return min(max(base, MIN_PART) << ((number - 1) // GROW_EVERY), MAX_PART)


def part_start(base: int, number: int) -> int:
    """Offset where part `number` (1-based) begins."""
    full, rest = divmod(number - 1, GROW_EVERY)
    # each finished group covers GROW_EVERY parts of that group's size
    done = sum(GROW_EVERY * part_size(base, g * GROW_EVERY + 1) for g in range(full))
    return done + rest * part_size(base, full * GROW_EVERY + 1)


def max_size(base: int) -> int:
    """The largest object the schedule can upload in MAX_PARTS parts."""
    return part_start(base, MAX_PARTS + 1)


def part_ranges(base: int, size: int, first: int = 1) -> Iterator[tuple[int, int, int]]:
    """(number, start, length) of every part from part `first` to the end of `size`
    bytes; a size of 0 is one empty part."""
    n, start = first, part_start(base, first)
    if first > 1 and start >= size:
        return
    while True:
        length = min(part_size(base, n), size - start)
        yield n, start, max(length, 0)
        start += length
        n += 1
        if start >= size:
            return
