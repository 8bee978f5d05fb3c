"""Metadata at scale: `ls -l`, stats and small files through objcache, s3fs-fuse and
rclone mount, in one run, on loopback S3 and on a WAN-like S3 (benchmarks/wanproxy.py).

    .venv/bin/python -m benchmarks.metadata [--files 10000] [--big 100000]

The bucket: `ten/` (FILES objects of 16 KiB, as written by a plain S3 client: no
metadata), `rand/` (100 directories of 100), `big/` and `big2/` (BIG empty objects each).

Per profile, each system from a fresh mount and cache: `ls -l ten` cold, then warm (the
same mount again); objcache also after a restart with its cache dir kept; reads of every
file of `ten/` with 8 threads, cold. On loopback only, through a counting proxy
(tests/helpers/s3proxy.py): the S3 requests of objcache's cold, restarted and
second-node `ls -l`, of s3fs's cold one, and of 2,000 random stats over `ten/` and
`rand/` after their directories were listed; the names of `big/` listed (`ls -f`),
`ls -l big`, and the daemon's RSS once `big2/` was listed too (200,000 inodes known).
Prints JSON per part and writes the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks.reads import RSS, wan_proxy
from benchmarks.single_node import drop_page_cache, remove_workdir
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount
from tests.helpers.s3proxy import CountingProxy
from tests.helpers.seaweed import SeaweedFS

BUCKET = "meta"
DOCS = Path(__file__).parents[1] / "docs"


def put_many(s3: Any, keys: list[str], body: bytes, threads: int = 32) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=BUCKET, Key=k, Body=body), keys))


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def ls_l(path: Path) -> float:
    return timed(["ls", "-l", str(path)])


def ls_names(path: Path) -> float:
    return timed(["ls", "-f", str(path)])


def read_tree(root: Path, names: list[str], threads: int = 8) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: (root / n).read_bytes(), names))
    return time.perf_counter() - t0


@contextmanager
def objcache(endpoint: str, work: Path, tag: str, cache: str | None = None
             ) -> Iterator[Mount]:
    m = Mount(endpoint, BUCKET, work / f"mnt-{tag}", work / f"cache-{cache or tag}",
              "--cache-size", "4G", "--log-level", "warning")
    try:
        yield m.start(timeout=120)
    finally:
        m.stop()


def timings(endpoint: str, work: Path, names: list[str]) -> dict[str, Any]:
    """The timed part of one S3 profile."""
    work.mkdir(parents=True, exist_ok=True)
    r: dict[str, Any] = {}
    ten = "ten"
    with objcache(endpoint, work, "oc", "oc") as m:
        r["objcache_ls_cold_s"] = ls_l(m.mnt / ten)
        r["objcache_ls_warm_s"] = ls_l(m.mnt / ten)
    with objcache(endpoint, work, "oc", "oc") as m:  # the same cache dir: a restart
        r["objcache_ls_restart_s"] = ls_l(m.mnt / ten)
    with objcache(endpoint, work, "oc-read", "oc-read") as m:
        drop_page_cache()
        r["objcache_read_cold_s"] = read_tree(m.mnt / ten, names)
    for name, mount in (("s3fs", peers.s3fs), ("rclone", peers.rclone)):
        try:
            with mount(endpoint, BUCKET, work, name) as (mnt, _):
                r[f"{name}_ls_cold_s"] = ls_l(mnt / ten)
                r[f"{name}_ls_warm_s"] = ls_l(mnt / ten)
            with mount(endpoint, BUCKET, work, name + "-read") as (mnt, _):
                drop_page_cache()
                r[f"{name}_read_cold_s"] = read_tree(mnt / ten, names)
        except Exception as e:  # a peer failing must not lose the other figures
            r[f"{name}_error"] = f"{type(e).__name__}: {e}"
    return r


def requests(weed: SeaweedFS, work: Path, rand_paths: list[str]) -> dict[str, Any]:
    """Request counts on loopback, through the counting proxy."""
    work.mkdir(parents=True, exist_ok=True)
    proxy = CountingProxy(weed.port).start()
    r: dict[str, Any] = {}

    def counts() -> dict[str, int]:
        with proxy.lock:
            out = dict(proxy.requests)
            proxy.requests.clear()
        return out

    try:
        with objcache(proxy.endpoint, work, "c1", "c1") as m:
            counts()
            ls_l(m.mnt / "ten")
            r["objcache_ls_cold"] = counts()
        with objcache(proxy.endpoint, work, "c1", "c1") as m:
            counts()
            ls_l(m.mnt / "ten")
            r["objcache_ls_restart"] = counts()
        mounts: list[Mount] = []
        try:
            (work / "cluster").mkdir(exist_ok=True)
            cluster = Cluster(proxy.endpoint, BUCKET, work / "cluster", mounts)
            a = cluster.add("--cache-size", "4G", "--log-level", "warning")
            b = cluster.add("--cache-size", "4G", "--log-level", "warning")
            cluster.wait_members([a, b], 2)
            ls_l(a.mnt / "ten")
            time.sleep(2)  # the HEAD answers reach the keys' owners
            counts()
            ls_l(b.mnt / "ten")
            r["objcache_ls_second_node"] = counts()
        finally:
            for mm in mounts:
                mm.stop()
        with objcache(proxy.endpoint, work, "c2", "c2") as m:
            for d in {os.path.dirname(p) for p in rand_paths}:
                os.listdir(m.mnt / d)
            counts()
            for p in rand_paths:
                os.stat(m.mnt / p)
            time.sleep(1)  # anything fetched ahead is counted too
            c = counts()
            r["objcache_random_stats"] = c
            r["objcache_requests_per_stat"] = sum(c.values()) / len(rand_paths)
        with peers.s3fs(proxy.endpoint, BUCKET, work) as (mnt, _):
            counts()
            ls_l(mnt / "ten")
            r["s3fs_ls_cold"] = counts()
    finally:
        proxy.stop()
    return r


def big_dirs(weed: SeaweedFS, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    r: dict[str, Any] = {}
    with objcache(weed.endpoint, work, "big", "big") as m:
        assert m.proc is not None
        rss = RSS(m.proc.pid)
        r["objcache_big_names_s"] = ls_names(m.mnt / "big")
        r["objcache_big_ls_l_s"] = ls_l(m.mnt / "big")
        r["objcache_big2_names_s"] = ls_names(m.mnt / "big2")
        time.sleep(0.5)
        r["objcache_rss_200k_inodes_bytes"] = rss.stop()
    with peers.s3fs(weed.endpoint, BUCKET, work) as (mnt, _):
        r["s3fs_big_names_s"] = ls_names(mnt / "big")
        r["s3fs_big_ls_l_s"] = ls_l(mnt / "big")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--big", type=int, default=100_000)
    ap.add_argument("--profiles", default="loopback,wan")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    peers.install()
    work = Path(tempfile.mkdtemp(prefix="objcache-meta-"))
    weed = SeaweedFS(work / "s3")
    weed.start()
    res: dict[str, Any] = {"files": args.files, "big_entries": args.big}
    try:
        s3 = weed.client()
        s3.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        names = [f"{i:05d}.rec" for i in range(args.files)]
        put_many(s3, [f"ten/{n}" for n in names], os.urandom(16 << 10))
        rand = [f"rand/d{j:03d}/{k:03d}" for j in range(100) for k in range(100)]
        put_many(s3, rand, b"r" * 100)
        if args.big:
            for d in ("big", "big2"):
                put_many(s3, [f"{d}/{i:06d}" for i in range(args.big)], b"")
        res["setup_s"] = time.perf_counter() - t0
        print("setup", round(res["setup_s"], 1), flush=True)
        rng = random.Random(1)
        picks = rng.sample([f"ten/{n}" for n in names] + rand, 2000)
        res["requests"] = requests(weed, work / "count", picks)
        print("requests", json.dumps(res["requests"]), flush=True)
        if args.big:
            res["big_dirs"] = big_dirs(weed, work / "bigdirs")
            print("big", json.dumps(res["big_dirs"]), flush=True)
        for profile in args.profiles.split(","):
            if profile == "wan":
                with wan_proxy(weed.port, 12, 80) as endpoint:
                    res[profile] = timings(endpoint, work / profile, names)
            else:
                res[profile] = timings(weed.endpoint, work / profile, names)
            print(profile, json.dumps(res[profile]), flush=True)
    finally:
        weed.stop()
        remove_workdir(work)
    if not args.no_report:
        write_report(res)


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def report(res: dict[str, Any]) -> list[str]:
    n = res["files"]
    out = [f"{n:,} files of 16 KiB in one directory; WAN: 12 ms each way, 80 MB/s per "
           "connection.", "",
           "| workload | profile | objcache | s3fs-fuse | rclone | objcache / s3fs | "
           "objcache / rclone |", "|---|---|---|---|---|---|---|"]
    for p in ("loopback", "wan"):
        r = res.get(p)
        if not r:
            continue
        for label, k in ((f"`ls -l` of {n:,}, cold", "ls_cold_s"),
                         (f"`ls -l` of {n:,}, warm", "ls_warm_s"),
                         (f"read {n:,} x 16 KiB, 8 threads, cold", "read_cold_s")):
            o, s, c = (r.get(f"{x}_{k}") for x in ("objcache", "s3fs", "rclone"))
            out.append(f"| {label} | {p} | {_s(o)} | {_s(s)} | {_s(c)} | {_x(o, s)} | "
                       f"{_x(o, c)} |")
        out.append(f"| `ls -l` of {n:,} after a restart (cache dir kept) | {p} | "
                   f"{_s(r.get('objcache_ls_restart_s'))} | | | | |")
    q = res.get("requests", {})
    if q:
        def c(d: dict[str, int] | None) -> str:
            d = d or {}
            return ", ".join(f"{k} {v:,}" for k, v in sorted(d.items())) or "none"
        out += ["", "S3 requests (loopback, counted at a proxy):", "",
                "| what | requests |", "|---|---|",
                f"| objcache `ls -l` of {n:,}, cold | {c(q.get('objcache_ls_cold'))} |",
                f"| objcache, restarted | {c(q.get('objcache_ls_restart'))} |",
                f"| objcache, a second node after the first | "
                f"{c(q.get('objcache_ls_second_node'))} |",
                f"| s3fs-fuse `ls -l` of {n:,}, cold | {c(q.get('s3fs_ls_cold'))} |",
                f"| objcache, 2,000 random stats in listed directories | "
                f"{c(q.get('objcache_random_stats'))}: "
                f"{q.get('objcache_requests_per_stat', 0):.2f} per stat |"]
    b = res.get("big_dirs")
    if b:
        e = res["big_entries"]
        out += ["", f"Big directories (loopback, {e:,} entries each): `ls -f big` (names) "
                f"{_s(b.get('objcache_big_names_s'))}, s3fs-fuse "
                f"{_s(b.get('s3fs_big_names_s'))}; `ls -l big` "
                f"{_s(b.get('objcache_big_ls_l_s'))}, s3fs-fuse "
                f"{_s(b.get('s3fs_big_ls_l_s'))}; daemon peak RSS once `big2` was "
                f"listed too ({2 * e:,} inodes known): "
                f"{b.get('objcache_rss_200k_inodes_bytes', 0) / 2**20:.0f} MiB."]
    return out


SECTION = "## Metadata at scale (`python -m benchmarks.metadata`)"


def write_report(res: dict[str, Any]) -> None:
    """Each run's table goes under the section (kept: runs are compared over time)."""
    path = DOCS / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION not in text:
        intro = "\n\n".join((__doc__ or "").split("\n\n")[2:4])
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{intro}\n"
    text = text.rstrip("\n") + f"\n\n### Run of {time.strftime('%Y-%m-%d %H:%M')} UTC\n\n"
    path.write_text(text + "\n".join(report(res)) + "\n")


if __name__ == "__main__":
    main()
