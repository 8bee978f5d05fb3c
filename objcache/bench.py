"""`objcache bench PATH`: a quick benchmark of a mounted directory (like `juicefs bench`).

It writes and reads big files, writes and reads many small files, stats and lists them,
and prints throughput and latencies. Reads drop the files' pages from the page cache first
(posix_fadvise), so they reach the filesystem; on objcache they are served from its cache,
which is what a second epoch of training sees. Everything it creates lives in one
directory under PATH, removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from objcache.config import parse_size
from objcache.errors import UserError

BLOCK = 1 << 20


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: str, size: int, block: bytes) -> float:
    """Write `size` bytes; returns the seconds close() took (write-back shows here)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
    finally:
        t0 = time.perf_counter()
        os.close(fd)
    return time.perf_counter() - t0


def _read(path: str) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, BLOCK):
            n += len(chunk)
    finally:
        os.close(fd)
    return n


def _timed(pool: ThreadPoolExecutor, fn: Any, items: list[Any]) -> tuple[float, list[float]]:
    """Run fn over items in the pool; (wall seconds, per-item latencies)."""
    def one(item: Any) -> float:
        t0 = time.perf_counter()
        fn(item)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    lat = list(pool.map(one, items))
    return time.perf_counter() - t0, lat


def _lat(lat: list[float]) -> dict[str, float]:
    ordered = sorted(lat)
    return {"avg_ms": round(1000 * statistics.fmean(ordered), 3),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3)}


def run_bench(path: str, big_size: int, big_files: int, small_count: int, small_size: int,
              threads: int) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a directory")
    root = os.path.join(path, f".objcache-bench-{uuid.uuid4().hex[:8]}")
    os.mkdir(root)
    block = os.urandom(BLOCK)
    small_block = os.urandom(max(1, small_size))
    out: dict[str, Any] = {"path": path, "threads": threads}
    try:
        with ThreadPoolExecutor(threads) as pool:
            bigs = [os.path.join(root, f"big.{i}") for i in range(big_files)]
            closes: list[float] = []
            secs, _ = _timed(pool, lambda p: closes.append(_write(p, big_size, block)), bigs)
            out["big_write"] = {"MBps": round(big_files * big_size / secs / 1e6, 1),
                                "seconds": round(secs, 3),
                                "close_ms_max": round(1000 * max(closes), 3)}
            for p in bigs:
                _drop_pages(p)
            secs, _ = _timed(pool, _read, bigs)
            out["big_read"] = {"MBps": round(big_files * big_size / secs / 1e6, 1),
                               "seconds": round(secs, 3)}

            small_dir = os.path.join(root, "small")
            os.mkdir(small_dir)
            smalls = [os.path.join(small_dir, f"f{i:06d}") for i in range(small_count)]
            secs, lat = _timed(pool, lambda p: _write(p, small_size, small_block), smalls)
            out["small_write"] = {"files_per_s": round(small_count / secs, 1), **_lat(lat)}
            for p in smalls:
                _drop_pages(p)
            secs, lat = _timed(pool, _read, smalls)
            out["small_read"] = {"files_per_s": round(small_count / secs, 1), **_lat(lat)}
            secs, lat = _timed(pool, os.stat, smalls)
            out["stat"] = {"ops_per_s": round(small_count / secs, 1), **_lat(lat)}
            t0 = time.perf_counter()
            listed = len(os.listdir(small_dir))
            secs = time.perf_counter() - t0
            out["list"] = {"entries": listed, "entries_per_s": round(listed / secs, 1),
                           "ms": round(1000 * secs, 3)}
    finally:
        t0 = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        out["cleanup_s"] = round(time.perf_counter() - t0, 3)
    return out


def main(path: str, big_size: str, big_files: int, small_count: int, small_size: str,
         threads: int, as_json: bool) -> int:
    res = run_bench(path, parse_size(big_size, "big-size"), big_files, small_count,
                    parse_size(small_size, "small-size"), threads)
    if as_json:
        print(json.dumps(res, indent=2))
        return 0
    mib = 1 << 20
    bsz = parse_size(big_size)
    print(f"objcache bench of {path} ({threads} threads)")
    print(f"  big file write   {res['big_write']['MBps']:9.1f} MB/s   "
          f"({big_files} x {bsz / mib:.0f} MiB, slowest close() "
          f"{res['big_write']['close_ms_max']:.1f} ms)")
    print(f"  big file read    {res['big_read']['MBps']:9.1f} MB/s")
    for name, label in (("small_write", "small file write"), ("small_read", "small file read")):
        r = res[name]
        print(f"  {label:<16} {r['files_per_s']:9.1f} files/s  avg {r['avg_ms']:.2f} ms, "
              f"p99 {r['p99_ms']:.2f} ms")
    print(f"  stat             {res['stat']['ops_per_s']:9.1f} ops/s    "
          f"avg {res['stat']['avg_ms']:.2f} ms")
    print(f"  list             {res['list']['entries_per_s']:9.1f} entries/s "
          f"({res['list']['entries']} in {res['list']['ms']:.1f} ms)")
    return 0
