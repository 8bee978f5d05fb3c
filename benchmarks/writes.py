"""The checkpoint moment: `torch.save` of a state dict through objcache, against saving to
a local file on the cache disk and against "save locally, then upload with boto3", in one
run, on loopback S3 and on a WAN-like S3 (benchmarks/wanproxy.py).

    .venv/bin/python -m benchmarks.writes [--size 1G] [--profiles loopback,wan]

Per profile: `torch.save` to a local file on the cache disk; a boto3 multipart upload of
that file (8 threads, 16 MiB parts); objcache on one node and on a 3-node cluster with 2
replicas: the time until `torch.save` returns, and the time from its start until the
object is complete in S3. On loopback also: three checkpoints back to back into a cache of
1.5x one checkpoint (2x the cache in all), each compared with its local twin in S3. Every
save runs in a fresh process. Peak daemon RSS is sampled throughout. Prints JSON and
returns the figures; benchmarks.compare writes them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.reads import _x, sampling, wan_proxy
from benchmarks.single_node import remove_workdir
from objcache.config import parse_size
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS

MiB = 1 << 20
TENSORS = 16
# The state dict is built before the clock starts; the figure is torch.save alone (it
# returns after close()). The seed makes two saves of one size byte-identical.
SAVE = ("import sys, time, torch\nn, size = int(sys.argv[2]), int(sys.argv[3])\n"
        "g = torch.Generator().manual_seed(int(sys.argv[4]))\n"
        "d = {f'layer{i:02d}.weight': torch.rand(size // n // 4, generator=g) "
        "for i in range(n)}\n"
        "t0, w0 = time.perf_counter(), time.time()\ntorch.save(d, sys.argv[1])\n"
        "print(time.perf_counter() - t0, w0)\n")


def save(path: Path, size: int, seed: int = 0) -> tuple[float, float]:
    """(seconds torch.save took, wall-clock time it started)."""
    out = subprocess.run([sys.executable, "-c", SAVE, str(path), str(TENSORS), str(size),
                          str(seed)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"torch.save to {path} failed: {out.stderr.strip()[-400:]}")
    secs, start = out.stdout.split()
    return float(secs), float(start)


def in_s3_after(s3: Any, bucket: str, key: str, size: int, start: float,
                timeout: float = 600) -> float:
    """Seconds from `start` (wall clock) until `key` is complete in S3 with `size` bytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == size:
                return time.time() - start
        except Exception:  # not there yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{key} not in S3 after {timeout} s")


def s3_digest(s3: Any, bucket: str, key: str) -> str:
    h = hashlib.blake2b()
    for piece in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(8 * MiB):
        h.update(piece)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while piece := f.read(8 * MiB):
            h.update(piece)
    return h.hexdigest()


def client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                        config=Config(max_pool_connections=16,
                                      s3={"addressing_style": "path"}))


def measure(endpoint: str, s3: Any, bucket: str, work: Path, size: int,
            back_to_back: bool) -> dict[str, Any]:
    """Every figure of one S3 profile (`endpoint`). `s3` talks to S3 directly (polling)."""
    from boto3.s3.transfer import TransferConfig
    work.mkdir(exist_ok=True)
    r: dict[str, Any] = {}
    local = work / "local" / "ckpt.pt"
    local.parent.mkdir(exist_ok=True)
    r["local_save_s"], _ = save(local, size)
    real = local.stat().st_size
    r["bytes"] = real
    t0 = time.perf_counter()
    client(endpoint).upload_file(str(local), bucket, "boto3.pt", Config=TransferConfig(
        multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8))
    r["boto3_upload_s"] = time.perf_counter() - t0
    ref = file_digest(local)

    mounts: list[Mount] = []
    try:
        m = Mount(endpoint, bucket, work / "mnt", work / "cache", "--cache-size", "8G",
                  "--log-level", "warning")
        mounts.append(m)
        m.start(timeout=120)
        assert m.proc is not None
        with sampling(m.proc.pid) as rss:
            r["save_s"], start = save(m.mnt / "ckpt.pt", size)
            r["in_s3_s"] = in_s3_after(s3, bucket, "ckpt.pt", real, start)
        r["rss_bytes"] = rss.peak
        assert s3_digest(s3, bucket, "ckpt.pt") == ref, "single node: S3 bytes differ"
        m.stop()

        root = work / "cluster"
        root.mkdir(exist_ok=True)
        cluster = Cluster(endpoint, bucket, root, mounts)
        nodes = [cluster.add("--cache-size", "8G", "--replicas", "2", "--log-level",
                             "warning", start=False) for _ in range(3)]
        for n in nodes:
            n.start(timeout=120)
        cluster.wait_members(nodes, 3)
        first = nodes[0]
        assert first.proc is not None
        # the same file name as the local twin: torch.save names the archive after it
        (first.mnt / "cluster").mkdir()
        with sampling(first.proc.pid) as rss:
            r["cluster_save_s"], start = save(first.mnt / "cluster" / "ckpt.pt", size)
            r["cluster_in_s3_s"] = in_s3_after(s3, bucket, "cluster/ckpt.pt", real, start)
        r["cluster_rss_bytes"] = rss.peak
        assert s3_digest(s3, bucket, "cluster/ckpt.pt") == ref, "cluster: S3 bytes differ"
        for n in nodes:
            n.stop()

        if back_to_back:
            r.update(_back_to_back(endpoint, s3, bucket, work, size, mounts))
    finally:
        for m in mounts:
            m.stop()
    return r


def _back_to_back(endpoint: str, s3: Any, bucket: str, work: Path, size: int,
                  mounts: list[Mount]) -> dict[str, Any]:
    """Three checkpoints into a cache of 1.5 checkpoints, each compared in S3."""
    cache = size * 3 // 2
    m = Mount(endpoint, bucket, work / "mnt-b2b", work / "cache-b2b", "--cache-size",
              str(cache), "--log-level", "warning")
    mounts.append(m)
    m.start(timeout=120)
    assert m.proc is not None
    secs: list[float] = []
    failed = ""
    with sampling(m.proc.pid) as rss:
        for i in range(3):
            (m.mnt / f"b2b{i}").mkdir()
            try:
                secs.append(save(m.mnt / f"b2b{i}" / "ckpt.pt", size, seed=i + 1)[0])
            except RuntimeError as e:  # a target miss to report, not a crash
                failed = f"{e}; daemon log: " + " | ".join(
                    ln for ln in m.log_path.read_text().splitlines()[-400:]
                    if " WARNING " in ln or " ERROR " in ln or "waits" in ln)[-1500:]
                secs.append(float("nan"))
        objcache("flush", str(m.mnt), timeout=600)
    exact = 0
    for i in range(3):
        if secs[i] != secs[i]:  # the save failed
            continue
        twin = work / "local" / "ckpt.pt"
        save(twin, size, seed=i + 1)
        exact += s3_digest(s3, bucket, f"b2b{i}/ckpt.pt") == file_digest(twin)
        twin.unlink()
    st = m.status()["cache"]
    m.stop()
    return {"b2b_cache_bytes": cache, "b2b_save_s": secs, "b2b_exact": exact,
            "b2b_write_waits": st["write_waits"],
            "b2b_write_wait_s": st["write_wait_seconds"], "b2b_rss_bytes": rss.peak,
            "b2b_failed": failed}


def run(size: int, profiles: list[str], work: Path | None = None,
        weed: SeaweedFS | None = None) -> dict[str, Any]:
    own = work is None
    work = work or Path(tempfile.mkdtemp(prefix="objcache-writes-"))
    started = weed is None
    if weed is None:
        weed = SeaweedFS(work)
        weed.start()
    out: dict[str, Any] = {"size": size}
    try:
        s3 = weed.client()
        for profile in profiles:
            bucket = f"writes-{profile}"
            s3.create_bucket(Bucket=bucket)
            if profile == "wan":
                with wan_proxy(weed.port, 12, 80) as endpoint:
                    out[profile] = measure(endpoint, s3, bucket, work / profile, size,
                                           False)
            else:
                out[profile] = measure(weed.endpoint, s3, bucket, work / profile, size,
                                       True)
            print(profile, json.dumps(out[profile]), flush=True)
    finally:
        if started:
            weed.stop()
        if own:
            remove_workdir(work)
    return out


def report(res: dict[str, Any]) -> list[str]:
    """Markdown tables of a run with the ratios issue 15 targets."""
    lines = []
    for profile in ("loopback", "wan"):
        r = res.get(profile)
        if not r:
            continue
        loc, up = r["local_save_s"], r["boto3_upload_s"]
        title = ("S3 on loopback" if profile == "loopback" else
                 "WAN-like S3 (12 ms each way, 80 MB/s per connection)")
        rows = [
            ("torch.save returns, 1 node", r["save_s"], _x(r["save_s"], loc) + " local",
             "<= 1.3x"),
            ("torch.save returns, 3 nodes, 2 replicas", r["cluster_save_s"],
             _x(r["cluster_save_s"], loc) + " local", "<= 2x"),
            ("start of save to complete in S3, 1 node", r["in_s3_s"],
             _x(r["in_s3_s"], loc + up) + " save-then-upload", "<= 1x"),
            ("start of save to complete in S3, 3 nodes", r["cluster_in_s3_s"],
             _x(r["cluster_in_s3_s"], loc + up) + " save-then-upload", ""),
        ]
        lines += [f"{title}: a {r['bytes'] / 2**30:.2f} GiB torch.save to a local file on "
                  f"the cache disk {loc:.2f} s; boto3 multipart upload of it {up:.2f} s "
                  f"(save-then-upload {loc + up:.2f} s).", "",
                  "| checkpoint | objcache (s) | ratio | target |", "|---|---|---|---|"]
        lines += [f"| {n} | {v:.2f} | {ratio} | {t} |" for n, v, ratio, t in rows]
        lines += [f"| peak daemon RSS, 1 node / cluster writer (MB) | "
                  f"{r['rss_bytes'] / 1e6:.0f} / {r['cluster_rss_bytes'] / 1e6:.0f} | | "
                  "< 200 |"]
        if "b2b_save_s" in r:
            lines += [f"| 3 checkpoints back to back into a "
                      f"{r['b2b_cache_bytes'] / 2**30:.2f} GiB cache: saves (s), "
                      f"byte-exact in S3 | "
                      + " / ".join(f"{s:.2f}" for s in r["b2b_save_s"])
                      + f" | {r['b2b_exact']}/3 exact; writers waited "
                      f"{r['b2b_write_wait_s']:.1f} s ({r['b2b_write_waits']} waits); "
                      f"RSS {r['b2b_rss_bytes'] / 1e6:.0f} MB | 3/3 |"]
            if r.get("b2b_failed"):
                lines += ["", f"Back to back: {r['b2b_failed']}"]
        lines += [""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--profiles", default="loopback,wan")
    args = ap.parse_args()
    res = run(parse_size(args.size), args.profiles.split(","))
    print(json.dumps(res, indent=1))
    print("\n".join(report(res)))


if __name__ == "__main__":
    main()
