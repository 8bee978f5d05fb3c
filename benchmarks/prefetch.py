"""Prefetch figures for docs/benchmarks.md: `objcache prefetch` of a dataset (many small
files and a few large ones) on 1 node and on a 3-node cluster, against a parallel boto3
download of the same objects (16 threads; large objects in 8 MiB ranged GETs).

Run: .venv/bin/python -m benchmarks.prefetch   (starts its own SeaweedFS on 127.0.0.1)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.single_node import MiB, remove_workdir
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import SeaweedFS

SMALL_FILES = 1000
SMALL_SIZE = 256 * 1024
LARGE_FILES = 2
LARGE_SIZE = 256 * MiB


def _boto3_download(s3, bucket: str, objects: list[tuple[str, int]]) -> float:  # type: ignore
    parts = [(k, off, min(8 * MiB, size - off)) for k, size in objects
             for off in range(0, size, 8 * MiB)]

    def get(p: tuple[str, int, int]) -> int:
        k, off, n = p
        r = s3.get_object(Bucket=bucket, Key=k, Range=f"bytes={off}-{off + n - 1}")
        return len(r["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        assert sum(pool.map(get, parts)) == sum(s for _, s in objects)
    return time.perf_counter() - t0


def _prefetch(mnt: Path) -> dict[str, float]:
    r = objcache("prefetch", "--json", str(mnt / "ds"), timeout=1800)
    out: dict[str, float] = json.loads(r.stdout)
    assert not out["failures"], out
    return out


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="objcache-bench-"))
    weed = SeaweedFS(work)
    weed.start()
    mounts: list[Mount] = []
    res: dict[str, object] = {}
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket="bench")
        objects = [(f"ds/small/{i:05d}.rec", SMALL_SIZE) for i in range(SMALL_FILES)]
        objects += [(f"ds/large/{i}.bin", LARGE_SIZE) for i in range(LARGE_FILES)]
        blob = os.urandom(LARGE_SIZE)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda o: s3.put_object(Bucket="bench", Key=o[0],
                                                  Body=blob[:o[1]]), objects))
        total = sum(s for _, s in objects)
        res["dataset"] = {"files": len(objects), "bytes": total}
        res["boto3_s"] = _boto3_download(s3, "bench", objects)

        single = Mount(weed.endpoint, "bench", work / "mnt-single", work / "cache-single",
                       "--cache-size", "4G", "--log-level", "info")
        mounts.append(single)
        single.start()
        res["one_node"] = _prefetch(single.mnt)
        res["one_node_again"] = _prefetch(single.mnt)
        single.stop()

        cluster = Cluster(weed.endpoint, "bench", work, mounts)
        nodes = [cluster.add("--cache-size", "4G", "--log-level", "info") for _ in range(3)]
        cluster.wait_members(nodes, 3)
        res["three_nodes"] = _prefetch(nodes[0].mnt)
        res["three_nodes_chunks"] = [n.status()["cache"]["chunks"] for n in nodes]
    finally:
        for m in mounts:
            m.stop()
        weed.stop()
        remove_workdir(work)
    print(json.dumps(res, indent=2))
    n = len(objects)
    b3 = float(res["boto3_s"])  # type: ignore[arg-type]
    print(f"dataset: {n} files, {total / MiB:.0f} MiB")
    print(f"boto3 16 threads      {total / b3 / 1e6:7.1f} MB/s {n / b3:7.1f} files/s")
    for name in ("one_node", "one_node_again", "three_nodes"):
        r = res[name]
        s = float(r["seconds"])  # type: ignore[index]
        print(f"prefetch {name:<13}{total / s / 1e6:7.1f} MB/s {n / s:7.1f} files/s "
              f"({r['bytes_fetched'] / MiB:.0f} MiB fetched)")  # type: ignore[index]


if __name__ == "__main__":
    main()
