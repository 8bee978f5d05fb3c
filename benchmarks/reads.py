"""The loading moment: a model and a big file read through objcache, against what a user
would do without it and against the ceilings, in one run, on loopback S3 and on a WAN-like
S3 (benchmarks/wanproxy.py: latency per request and a bandwidth cap per connection).

    .venv/bin/python -m benchmarks.reads [--size 1G] [--profiles loopback,wan]

Per profile: boto3 8 x 8 MiB ranged GETs of the big file (the ceiling); a local read of the
same bytes from the cache disk with the page cache dropped; "download with 8 x 8 MiB ranged
GETs, then load" of a safetensors model (16 tensors); objcache on one node: the model
loaded cold (fresh mount and cache) and warm (page cache dropped), the big file read cold
and warm; a second cluster node loading what the first holds; s3fs-fuse reading the big
file cold. Loads run `safetensors.torch.load_file` in a fresh process. Prints JSON and
returns the figures; benchmarks.compare writes them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.single_node import drop_page_cache, hold_to_cpus, read_file, remove_workdir
from objcache.config import parse_size
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS

MiB = 1 << 20
TENSORS = 16
# safetensors' default loader maps the file and reads nothing until a tensor is used:
# a load is done when every byte has reached memory (one byte of each page is read).
LOAD = ("import sys, time, torch\nimport safetensors.torch as st\nt = time.perf_counter()\n"
        "d = st.load_file(sys.argv[1])\nassert len(d) == {n}\n"
        "s = sum(int(v.view(torch.uint8)[::4096].sum()) for v in d.values())\n"
        "print(time.perf_counter() - t)\n")


def make_model(path: Path, size: int) -> None:
    """A safetensors file of `size` bytes in TENSORS float32 tensors (random values)."""
    subprocess.run([sys.executable, "-c",
                    "import sys, torch, safetensors.torch as st\n"
                    "n, size = int(sys.argv[2]), int(sys.argv[3])\n"
                    "t = {f'layer{i:02d}.weight': torch.rand(size // n // 4) for i in range(n)}\n"
                    "st.save_file(t, sys.argv[1])\n", str(path), str(TENSORS), str(size)],
                   check=True)


def load_seconds(path: Path) -> float:
    out = subprocess.run([sys.executable, "-c", LOAD.format(n=TENSORS), str(path)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def ranged_download(s3: Any, bucket: str, key: str, size: int, dest: Path | None,
                    part: int = 8 * MiB, threads: int = 8) -> float:
    """8 threads of 8 MiB ranged GETs (into `dest` when given); seconds."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if dest else -1
    t0 = time.perf_counter()

    def get(off: int) -> int:
        body = s3.get_object(Bucket=bucket, Key=key,
                             Range=f"bytes={off}-{off + part - 1}")["Body"].read()
        if fd >= 0:
            os.pwrite(fd, body, off)
        return len(body)
    try:
        with ThreadPoolExecutor(threads) as pool:
            assert sum(pool.map(get, range(0, size, part))) == size
    finally:
        if fd >= 0:
            os.close(fd)
    return time.perf_counter() - t0


class RSS:
    """Samples a process's resident memory every 0.1 s, from construction until stop()."""

    def __init__(self, pid: int) -> None:
        import threading
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


@contextmanager
def sampling(pid: int) -> Iterator[RSS]:
    rss = RSS(pid)
    try:
        yield rss
    finally:
        rss.stop()


@contextmanager
def wan_proxy(port: int, delay_ms: float, mbps: float,
              cpus: set[int] | None = None) -> Iterator[str]:
    """The WAN-like proxy in front of SeaweedFS's `port`; `cpus`: hold it to these."""
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.wanproxy", "--upstream",
                          f"127.0.0.1:{port}", "--delay-ms", str(delay_ms), "--mbps",
                          str(mbps)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        assert line.startswith("listening "), line
        if cpus:
            hold_to_cpus(p.pid, cpus)
        yield "http://" + line.split()[1]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(10)


def measure(endpoint: str, s3: Any, bucket: str, work: Path, size: int,
            model: Path) -> dict[str, Any]:
    """Every figure of one S3 profile (`endpoint`), with caches of its own in `work`."""
    work.mkdir(exist_ok=True)
    import boto3
    from botocore.config import Config
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                     config=Config(max_pool_connections=16,
                                   s3={"addressing_style": "path"}))
    r: dict[str, Any] = {}
    r["boto3_get_s"] = ranged_download(c, bucket, "big.bin", size, None)
    local = work / "downloaded.safetensors"
    msize = model.stat().st_size
    t = ranged_download(c, bucket, "model.safetensors", msize, local)
    r["download_s"] = t
    r["download_then_load_s"] = t + load_seconds(local)
    drop_page_cache()
    r["local_disk_read_s"] = read_file(local)
    local.unlink()

    mounts: list[Mount] = []
    try:
        def mount(tag: str) -> Mount:
            m = Mount(endpoint, bucket, work / f"mnt-{tag}", work / f"cache-{tag}",
                      "--cache-size", "8G", "--log-level", "warning")
            mounts.append(m)
            return m.start(timeout=120)

        m = mount("load")
        drop_page_cache()
        r["cold_load_s"] = load_seconds(m.mnt / "model.safetensors")
        drop_page_cache()
        r["warm_load_s"] = load_seconds(m.mnt / "model.safetensors")
        m.stop()
        m = mount("seq")
        assert m.proc is not None
        drop_page_cache()
        with sampling(m.proc.pid) as rss:
            r["cold_read_s"] = read_file(m.mnt / "big.bin")
        r["cold_read_rss_bytes"] = rss.peak
        drop_page_cache()
        r["warm_read_s"] = read_file(m.mnt / "big.bin")
        m.stop()

        root = work / "cluster"
        root.mkdir(exist_ok=True)
        cluster = Cluster(endpoint, bucket, root, mounts)
        a = cluster.add("--cache-size", "8G", "--log-level", "warning", start=False)
        a.start(timeout=120)
        b = cluster.add("--cache-size", "8G", "--log-level", "warning", start=False)
        b.start(timeout=120)
        cluster.wait_members([a, b], 2)
        drop_page_cache()
        r["cluster_first_load_s"] = load_seconds(a.mnt / "model.safetensors")
        drop_page_cache()
        r["cluster_second_node_load_s"] = load_seconds(b.mnt / "model.safetensors")
    finally:
        for m in mounts:
            m.stop()
    if shutil.which("s3fs"):
        r["s3fs_cold_read_s"] = s3fs_read(endpoint, bucket, work)
    return r


def s3fs_read(endpoint: str, bucket: str, work: Path) -> float | None:
    mnt = work / "mnt-s3fs"
    mnt.mkdir(exist_ok=True)
    creds = work / "s3fs.passwd"
    creds.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
    creds.chmod(0o600)
    cache = work / f"s3fs-cache-{time.monotonic_ns()}"
    p = subprocess.Popen(["s3fs", bucket, str(mnt), "-f", "-o",
                          f"url={endpoint},use_path_request_style,passwd_file={creds},"
                          f"use_cache={cache},parallel_count=8,multipart_size=16"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline or p.poll() is not None:
                return None
            time.sleep(0.1)
        drop_page_cache()
        return read_file(mnt / "big.bin")
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        shutil.rmtree(cache, ignore_errors=True)


def run(size: int, profiles: list[str], work: Path | None = None,
        weed: SeaweedFS | None = None) -> dict[str, Any]:
    own = work is None
    work = work or Path(tempfile.mkdtemp(prefix="objcache-reads-"))
    started = weed is None
    if weed is None:
        weed = SeaweedFS(work)
        weed.start()
    out: dict[str, Any] = {"size": size}
    try:
        s3 = weed.client()
        bucket = "reads"
        s3.create_bucket(Bucket=bucket)
        big = work / "big.src"
        with open(big, "wb") as f:
            for _ in range(size // (64 * MiB)):
                f.write(os.urandom(64 * MiB))
        s3.upload_file(str(big), bucket, "big.bin")
        big.unlink()
        model = work / "model.safetensors"
        make_model(model, size)
        s3.upload_file(str(model), bucket, "model.safetensors")
        for profile in profiles:
            if profile == "wan":
                with wan_proxy(weed.port, 12, 80) as endpoint:
                    out[profile] = measure(endpoint, s3, bucket, work / profile, size,
                                           model)
            else:
                out[profile] = measure(weed.endpoint, s3, bucket, work / profile, size,
                                       model)
            print(profile, json.dumps(out[profile]), flush=True)
    finally:
        if started:
            weed.stop()
        if own:
            remove_workdir(work)
    return out


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(res: dict[str, Any]) -> list[str]:
    """Markdown tables of a run, one row per figure, with the ratios issue 14 targets."""
    gb = res["size"] / 1e9
    lines = []
    for profile in ("loopback", "wan"):
        r = res.get(profile)
        if not r:
            continue
        dtl, ceil = r["download_then_load_s"], r["boto3_get_s"]
        title = ("S3 on loopback" if profile == "loopback" else
                 "WAN-like S3 (12 ms each way, 80 MB/s per connection)")
        rows = [
            ("cold load, 1 node", r["cold_load_s"],
             f"{_x(r['cold_load_s'], dtl)} download-then-load", "<= 0.9x"),
            ("warm load, 1 node (page cache dropped)", r["warm_load_s"],
             f"{_x(r['warm_load_s'], dtl)} download-then-load", ""),
            ("load on a 2nd node, from what the cluster holds",
             r["cluster_second_node_load_s"],
             f"{_x(r['cluster_second_node_load_s'], dtl)} download-then-load", "<= 0.6x"),
            ("load on the cluster's 1st node (cold)", r["cluster_first_load_s"],
             f"{_x(r['cluster_first_load_s'], dtl)} download-then-load", ""),
            ("sequential read cold", r["cold_read_s"],
             f"{_x(ceil, r['cold_read_s'])} of the boto3 ceiling, "
             f"{_x(r.get('s3fs_cold_read_s'), r['cold_read_s'])} s3fs-fuse's speed",
             ">= 0.8x, >= 1.5x"),
            ("sequential read warm (page cache dropped)", r["warm_read_s"],
             f"{_x(r['local_disk_read_s'], r['warm_read_s'])} of a local file's speed",
             ">= 0.8x"),
        ]
        lines += [f"{title}: boto3 8 x 8 MiB ranged GETs {ceil:.2f} s "
                  f"({gb / ceil:.2f} GB/s); download with them, then load "
                  f"{dtl:.2f} s; a local file on the cache disk read in "
                  f"{r['local_disk_read_s']:.2f} s; s3fs-fuse cold read "
                  + (f"{r['s3fs_cold_read_s']:.2f} s." if r.get("s3fs_cold_read_s")
                     else "not run."), "",
                  "| 1 GiB | objcache (s) | ratio | target |", "|---|---|---|---|"]
        lines += [f"| {n} | {v:.2f} | {ratio} | {t} |" for n, v, ratio, t in rows]
        lines += [f"| peak daemon RSS, cold read (MB) | {r['cold_read_rss_bytes'] / 1e6:.0f}"
                  " | | < 200 |", ""]
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
