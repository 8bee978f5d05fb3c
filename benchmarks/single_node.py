"""Single-node figures for docs/benchmarks.md: 1 GiB sequential read cold (from S3), warm
(from the chunk cache, page cache dropped), re-read (page cache), against a boto3 parallel
ranged download; and close() of a 1 GiB written file against a direct multipart upload.

Run: .venv/bin/python -m benchmarks.single_node   (starts its own SeaweedFS on 127.0.0.1)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import SeaweedFS

GiB = 1 << 30
MiB = 1 << 20


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        print("(cannot drop the page cache: warm numbers include it)", file=sys.stderr)


def hold_to_cpus(pid: int, cpus: set[int]) -> None:
    """Hold every thread of process `pid` to `cpus`. Threads it starts later are cloned from
    held ones and inherit the mask (as Go's runtime does for SeaweedFS)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def threads_off_cpus(pid: int, cpus: set[int]) -> int:
    """How many threads of `pid` may run outside `cpus` (0 while hold_to_cpus holds)."""
    off = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            off += not os.sched_getaffinity(int(tid)) <= cpus
        except ProcessLookupError:
            pass
    return off


def read_file(path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, MiB):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def remove_workdir(work: Path) -> None:
    """A run leaves gigabytes (the data, the caches): remove them, unless something is
    still mounted inside (rm -rf through a live mount would delete the data behind it)."""
    live = [p for p in work.iterdir() if p.is_dir() and os.path.ismount(p)]
    if live:
        print(f"not removing {work}: still mounted: {live}")
        return
    shutil.rmtree(work, ignore_errors=True)


def boto3_download(s3, bucket: str, key: str, size: int, part: int = 8 * MiB,  # type: ignore
                   threads: int = 8) -> float:
    t0 = time.perf_counter()

    def get(off: int) -> int:
        r = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + part - 1}")
        return len(r["Body"].read())
    with ThreadPoolExecutor(threads) as pool:
        assert sum(pool.map(get, range(0, size, part))) == size
    return time.perf_counter() - t0


def upload_random(s3, work: Path, bucket: str, key: str, size: int) -> Path:  # type: ignore
    """Put `size` random bytes at `key` (multipart, as boto3 does); returns the local copy."""
    src = work / f"{key.replace('/', '_')}.src"
    with open(src, "wb") as f:
        for _ in range(max(1, size // (64 * MiB))):
            f.write(os.urandom(min(size, 64 * MiB)))
    s3.upload_file(str(src), bucket, key)
    return src


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="objcache-bench-"))
    weed = SeaweedFS(work)
    weed.start()
    results: dict[str, float] = {}
    m: Mount | None = None
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket="bench")
        src = upload_random(s3, work, "bench", "big.bin", GiB)
        results["boto3_parallel_get_s"] = boto3_download(s3, "bench", "big.bin", GiB)
        m = Mount(weed.endpoint, "bench", work / "mnt", work / "cache", "--cache-size", "4G",
                  "--writeback-delay", "3600", "--log-level", "info").start()
        drop_page_cache()
        results["cold_read_s"] = read_file(m.mnt / "big.bin")
        drop_page_cache()
        results["warm_read_s"] = read_file(m.mnt / "big.bin")
        results["reread_s"] = read_file(m.mnt / "big.bin")
        # Checkpoint write: close() returns before S3 has it.
        t0 = time.perf_counter()
        fd = os.open(m.mnt / "ckpt.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with open(src, "rb") as f:
            while chunk := f.read(MiB):
                os.write(fd, chunk)
        t1 = time.perf_counter()
        os.close(fd)
        t2 = time.perf_counter()
        results["write_1g_s"] = t1 - t0
        results["close_s"] = t2 - t1
        objcache("flush", str(m.mnt), timeout=600)
        results["in_s3_after_close_s"] = time.perf_counter() - t2
        t0 = time.perf_counter()
        s3.upload_file(str(src), "bench", "direct.bin")
        results["boto3_upload_s"] = time.perf_counter() - t0
        status = m.status()
        results["s3_get_requests"] = float(status["s3"]["requests"].get("get", 0))
    finally:
        if m is not None:
            m.stop()
        weed.stop()
        remove_workdir(work)
    gb = GiB / 1e9
    print(json.dumps({k: round(v, 4) for k, v in results.items()}, indent=2))
    print(f"cold read      {gb / results['cold_read_s']:.2f} GB/s")
    print(f"warm read      {gb / results['warm_read_s']:.2f} GB/s (chunk cache, no page cache)")
    print(f"re-read        {gb / results['reread_s']:.2f} GB/s (page cache, keep_cache)")
    print(f"boto3 8x8MiB   {gb / results['boto3_parallel_get_s']:.2f} GB/s")
    print(f"write 1 GiB    {results['write_1g_s']:.2f} s; "
          f"close() {results['close_s'] * 1000:.1f} ms; "
          f"in S3 {results['in_s3_after_close_s']:.2f} s after close")
    print(f"boto3 upload   {results['boto3_upload_s']:.2f} s")


if __name__ == "__main__":
    main()
