"""The multipart part schedule covers 1 TiB in S3's 10,000 parts, with parts S3 accepts."""

from __future__ import annotations

from objcache.store.parts import MAX_PARTS, MIN_PART, max_size, part_ranges, part_size

MiB = 1 << 20


def test_ten_thousand_parts_cover_more_than_a_tebibyte_at_any_chunk_size() -> None:
    for base in (1 * MiB, 5 * MiB, 16 * MiB, 64 * MiB):
        assert max_size(base) >= 1 << 40
        assert part_size(base, MAX_PARTS) <= 5 << 30  # S3's largest part


def test_ranges_tile_the_file_and_only_the_last_part_is_small() -> None:
    for size in (0, 1, 16 * MiB, 16 * MiB + 1, 20_000 * 16 * MiB + 12345):
        ranges = list(part_ranges(16 * MiB, size))
        assert [n for n, _, _ in ranges] == list(range(1, len(ranges) + 1))
        assert len(ranges) <= MAX_PARTS
        pos = 0
        for _, start, length in ranges:
            assert start == pos
            pos += length
        assert pos == size
        assert all(length >= MIN_PART for _, _, length in ranges[:-1])


def test_ranges_from_a_later_part_continue_the_same_schedule() -> None:
    whole = list(part_ranges(5 * MiB, 3000 * 5 * MiB))
    assert list(part_ranges(5 * MiB, 3000 * 5 * MiB, first=1500)) == whole[1499:]
    assert list(part_ranges(5 * MiB, 10 * MiB, first=3)) == []
