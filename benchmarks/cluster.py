"""Cluster figures for docs/benchmarks.md: a 1 GiB file read through a 3-node cluster
(separate daemon processes on 127.0.0.1, SeaweedFS behind a counting proxy).

- cold: node 0 reads it first; every chunk is fetched from S3 once, by its owner;
- peers: nodes 1 and 2 then read it (page cache dropped), served by the owners' caches;
- single node cold: a standalone mount with an empty cache, for the same-run ratio;
- boto3: 8 threads of 8 MiB ranged GETs, the S3 ceiling;
- S3 bytes fetched in total for the three cluster reads (the daemons' own counters; the
  tests prove the same with a counting proxy, which is kept out of the timed path here).

Run: .venv/bin/python -m benchmarks.cluster   (starts its own SeaweedFS on 127.0.0.1)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.single_node import (
    GiB,
    MiB,
    boto3_download,
    drop_page_cache,
    read_file,
    remove_workdir,
    upload_random,
)
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount
from tests.helpers.seaweed import SeaweedFS


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="objcache-bench-"))
    weed = SeaweedFS(work)
    weed.start()
    mounts: list[Mount] = []
    r: dict[str, float] = {}
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket="bench")
        upload_random(s3, work, "bench", "model.bin", GiB).unlink()
        r["boto3_parallel_get_s"] = boto3_download(s3, "bench", "model.bin", GiB)

        cluster = Cluster(weed.endpoint, "bench", work, mounts)
        nodes = [cluster.add("--cache-size", "4G", "--log-level", "info") for _ in range(3)]
        cluster.wait_members(nodes, 3)
        drop_page_cache()
        r["cluster_cold_read_s"] = read_file(nodes[0].mnt / "model.bin")
        for i in (1, 2):
            drop_page_cache()
            r[f"peer_read_node{i}_s"] = read_file(nodes[i].mnt / "model.bin")
        st = [n.status() for n in nodes]
        r["s3_bytes_three_reads"] = sum(s["cache"]["bytes_read_from_s3"] for s in st)
        r["s3_gets_three_reads"] = sum(s["s3"]["requests"].get("get", 0) for s in st)
        r["chunks_per_node"] = [s["cache"]["chunks"] for s in st]  # type: ignore[assignment]
        for n in nodes:
            n.stop()

        single = Mount(weed.endpoint, "bench", work / "mnt-single", work / "cache-single",
                       "--cache-size", "4G", "--log-level", "info")
        mounts.append(single)
        single.start()
        drop_page_cache()
        r["single_cold_read_s"] = read_file(single.mnt / "model.bin")
    finally:
        for m in mounts:
            m.stop()
        weed.stop()
        remove_workdir(work)
    gb = GiB / 1e9
    print(json.dumps(r, indent=2))
    print(f"boto3 8x8MiB ranged GETs    {gb / r['boto3_parallel_get_s']:.2f} GB/s")
    print(f"single node, cold           {gb / r['single_cold_read_s']:.2f} GB/s")
    print(f"3-node cluster, cold        {gb / r['cluster_cold_read_s']:.2f} GB/s")
    for i in (1, 2):
        print(f"3-node cluster, from peers  {gb / r[f'peer_read_node{i}_s']:.2f} GB/s "
              f"(node {i})")
    print(f"S3 bytes for 3 reads of 1 GiB: {r['s3_bytes_three_reads'] / MiB:.0f} MiB in "
          f"{r['s3_gets_three_reads']} GETs; chunks per node {r['chunks_per_node']}")


if __name__ == "__main__":
    main()
