"""objcache side by side with s3fs-fuse and rclone mount, in one run on one machine.

    .venv/bin/python -m benchmarks.compare [--small-files 10000] [--big-size 1G]

Starts SeaweedFS on 127.0.0.1, creates the data, and measures the ceilings (boto3 parallel
ranged GETs and multipart PUT, a page-cache read of a local file), objcache on one node
and on a 3-node cluster, and s3fs-fuse and rclone mount with their disk caches on (Debian
packages `s3fs` and `rclone`, installed here if missing). Workloads: sequential read of
the big file cold / warm / re-read; the small files read cold and warm; `ls -l` of their
directory cold and warm; writing a checkpoint of the big size (until close() returns and
until it is in S3); a node reading the big file that another node cached, against boto3;
prefetch of the small files; peak daemon RSS. Writes docs/benchmarks-compare.md (a table
with the ratios) and docs/benchmarks-compare.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import peers, reads, writes
from benchmarks.reads import RSS
from benchmarks.single_node import (
    boto3_download,
    drop_page_cache,
    read_file,
    remove_workdir,
    upload_random,
)
from objcache.config import parse_size
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.seaweed import SeaweedFS

MiB = 1 << 20
DOCS = Path(__file__).parents[1] / "docs"


def _read_tree(root: Path, names: list[str], threads: int = 8) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: (root / n).read_bytes(), names))
    return time.perf_counter() - t0


def _ls_l(path: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["ls", "-l", str(path)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _write_checkpoint(path: Path, size: int, s3: Any, bucket: str, key: str) -> tuple[float,
                                                                                      float]:
    block = os.urandom(MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for _ in range(size // MiB):
        os.write(fd, block)
    os.close(fd)
    closed = time.perf_counter() - t0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == size:
                break
        except Exception:
            pass
        time.sleep(0.1)
    return closed, time.perf_counter() - t0


class System:
    """One filesystem under test: mount() returns (mountpoint, pid) and umount()."""

    def __init__(self, name: str, mount: Callable[[], tuple[Path, int]],
                 umount: Callable[[], None]) -> None:
        self.name, self.mount, self.umount = name, mount, umount


def _measure(sys_: System, s3: Any, bucket: str, big: str, big_size: int, small: list[str],
             r: dict[str, Any]) -> None:
    """The per-system workloads. Cold numbers come from a fresh mount and cache."""
    mnt, pid = sys_.mount()
    rss = RSS(pid)
    try:
        drop_page_cache()
        r["ls_cold_s"] = _ls_l(mnt / "small")
        r["ls_warm_s"] = _ls_l(mnt / "small")
        drop_page_cache()
        r["small_cold_s"] = _read_tree(mnt / "small", small)
        drop_page_cache()
        r["small_warm_s"] = _read_tree(mnt / "small", small)
        drop_page_cache()
        r["seq_cold_s"] = read_file(mnt / big)
        drop_page_cache()
        r["seq_warm_s"] = read_file(mnt / big)
        r["reread_s"] = read_file(mnt / big)
        # the page-cache ceiling is a second read of pages already read once: the same here
        r["reread2_s"] = read_file(mnt / big)
        key = f"ckpt-{sys_.name}.bin"
        r["ckpt_close_s"], r["ckpt_in_s3_s"] = _write_checkpoint(mnt / key, big_size, s3,
                                                                 bucket, key)
    finally:
        r["peak_rss_bytes"] = rss.stop()
        sys_.umount()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-files", type=int, default=10_000)
    ap.add_argument("--big-size", default="1G")
    ap.add_argument("--read-profiles", default="loopback,wan",
                    help="S3 profiles of the model-loading benchmark (benchmarks.reads); "
                         "empty: skip it")
    ap.add_argument("--write-profiles", default="loopback,wan",
                    help="S3 profiles of the checkpoint benchmark (benchmarks.writes); "
                         "empty: skip it")
    args = ap.parse_args()
    big_size = parse_size(args.big_size)
    peers.install()

    work = Path(tempfile.mkdtemp(prefix="objcache-compare-"))
    weed = SeaweedFS(work)
    weed.start()
    results: dict[str, dict[str, Any]] = {}
    mounts: list[Mount] = []
    try:
        s3 = weed.client()
        bucket = "cmp"
        s3.create_bucket(Bucket=bucket)
        t0 = time.perf_counter()
        src = upload_random(s3, work, bucket, "big.bin", big_size)
        ceil: dict[str, Any] = {"multipart_put_s": time.perf_counter() - t0}  # (+ local write)
        body = os.urandom(16 * 1024)
        small = [f"{i:05d}.rec" for i in range(args.small_files)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: s3.put_object(Bucket=bucket, Key=f"small/{n}", Body=body),
                          small))
        ceil["parallel_get_s"] = boto3_download(s3, bucket, "big.bin", big_size)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: s3.get_object(Bucket=bucket,
                                                  Key=f"small/{n}")["Body"].read(), small))
        ceil["small_get_s"] = time.perf_counter() - t0
        read_file(src)
        ceil["page_cache_read_s"] = read_file(src)
        results["ceilings"] = ceil

        def objcache_mount(tag: str) -> tuple[Path, int]:
            m = Mount(weed.endpoint, bucket, work / f"mnt-{tag}", work / f"cache-{tag}",
                      "--cache-size", "8G", "--log-level", "warning")
            mounts.append(m)
            m.start()
            assert m.proc is not None
            return m.mnt, m.proc.pid

        def objcache_umount() -> None:
            mounts[-1].stop()

        systems = [System("objcache", lambda: objcache_mount("one"), objcache_umount)]

        peer_mounts: list[ExitStack] = []

        def peer(fn: Callable[..., Any], name: str) -> System:
            def mount() -> tuple[Path, int]:
                stack = ExitStack()
                peer_mounts.append(stack)
                return stack.enter_context(fn(weed.endpoint, bucket, work, name))
            return System(name, mount, lambda: peer_mounts.pop().close())

        if shutil.which("s3fs"):
            systems.append(peer(peers.s3fs, "s3fs"))
        if shutil.which("rclone"):
            systems.append(peer(peers.rclone, "rclone"))
        for sys_ in systems:
            r: dict[str, Any] = {}
            try:
                _measure(sys_, s3, bucket, "big.bin", big_size, small, r)
            except Exception as e:  # one failing system must not lose the others' figures
                r["error"] = f"{type(e).__name__}: {e}"
            results[sys_.name] = r
            print(sys_.name, json.dumps(r), flush=True)

        # The cluster: node 1 reads what node 0 cached; prefetch of the small files.
        cl: dict[str, Any] = {}
        (work / "cluster").mkdir()
        cluster = Cluster(weed.endpoint, bucket, work / "cluster", mounts)
        nodes = [cluster.add("--cache-size", "8G", "--log-level", "warning")
                 for _ in range(3)]
        cluster.wait_members(nodes, 3)
        rss_nodes = [RSS(n.proc.pid) for n in nodes if n.proc is not None]
        drop_page_cache()
        cl["cold_s"] = read_file(nodes[0].mnt / "big.bin")
        drop_page_cache()
        cl["peer_read_s"] = read_file(nodes[1].mnt / "big.bin")
        out = json.loads(objcache("prefetch", "--json", str(nodes[2].mnt / "small"),
                                  timeout=1800).stdout)
        cl["prefetch_small_s"] = out["seconds"]
        cl["prefetch_fetched"] = out["bytes_fetched"]
        # Drain: 1024 dirty files (64 KiB) written through node 2, then node 2 leaves.
        dirty = os.urandom(64 * 1024)
        (nodes[2].mnt / "dirty").mkdir()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: (nodes[2].mnt / "dirty" / f"{i:04d}.bin").write_bytes(
                dirty), range(1024)))
        t0 = time.perf_counter()
        objcache("drain", str(nodes[2].mnt), timeout=1800)
        cl["drain_1024_s"] = time.perf_counter() - t0
        cl["drain_in_s3"] = sum(p.get("KeyCount", 0) for p in s3.get_paginator(
            "list_objects_v2").paginate(Bucket=bucket, Prefix="dirty/"))
        cl["peak_rss_bytes"] = max(r.stop() for r in rss_nodes)
        results["objcache_3_nodes"] = cl
        for m in mounts:
            m.stop()
        mounts.clear()
        if args.read_profiles:
            (work / "reads").mkdir()
            results["reads"] = reads.run(big_size, args.read_profiles.split(","),
                                         work / "reads", weed)
        if args.write_profiles:
            (work / "writes").mkdir()
            results["writes"] = writes.run(big_size, args.write_profiles.split(","),
                                           work / "writes", weed)
    finally:
        for m in mounts:
            m.stop()
        weed.stop()
        remove_workdir(work)
    write_report(results, big_size, args.small_files)



def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def write_report(res: dict[str, Any], big_size: int, n_small: int) -> None:
    gb = big_size / 1e9
    c = res["ceilings"]
    o, f, rc = res.get("objcache", {}), res.get("s3fs", {}), res.get("rclone", {})
    cl = res.get("objcache_3_nodes", {})

    def rate(d: dict[str, Any], k: str) -> float | None:
        return gb / d[k] if d.get(k) else None

    def files(d: dict[str, Any], k: str) -> float | None:
        return n_small / d[k] if d.get(k) else None

    rows = [
        ("seq read cold (GB/s)", rate(o, "seq_cold_s"), rate(f, "seq_cold_s"),
         rate(rc, "seq_cold_s"), "vs boto3 ceiling " + _ratio(rate(o, "seq_cold_s"),
                                                             gb / c["parallel_get_s"])),
        ("seq read warm (GB/s)", rate(o, "seq_warm_s"), rate(f, "seq_warm_s"),
         rate(rc, "seq_warm_s"), "vs s3fs " + _ratio(rate(o, "seq_warm_s"),
                                                     rate(f, "seq_warm_s"))),
        ("re-read (GB/s)", rate(o, "reread_s"), rate(f, "reread_s"), rate(rc, "reread_s"),
         "vs page cache " + _ratio(rate(o, "reread_s"), gb / c["page_cache_read_s"])),
        ("re-read, 2nd pass (GB/s)", rate(o, "reread2_s"), rate(f, "reread2_s"),
         rate(rc, "reread2_s"),
         "vs page cache " + _ratio(rate(o, "reread2_s"), gb / c["page_cache_read_s"])),
        (f"{n_small} x 16 KiB cold (files/s)", files(o, "small_cold_s"),
         files(f, "small_cold_s"), files(rc, "small_cold_s"),
         "vs s3fs " + _ratio(files(o, "small_cold_s"), files(f, "small_cold_s"))
         + ", vs rclone " + _ratio(files(o, "small_cold_s"), files(rc, "small_cold_s"))),
        (f"{n_small} x 16 KiB warm (files/s)", files(o, "small_warm_s"),
         files(f, "small_warm_s"), files(rc, "small_warm_s"), ""),
        ("ls -l cold (s)", o.get("ls_cold_s"), f.get("ls_cold_s"), rc.get("ls_cold_s"),
         "rclone / objcache " + _ratio(rc.get("ls_cold_s"), o.get("ls_cold_s"))),
        ("ls -l warm (s)", o.get("ls_warm_s"), f.get("ls_warm_s"), rc.get("ls_warm_s"), ""),
        ("checkpoint write until close() returns (s)", o.get("ckpt_close_s"),
         f.get("ckpt_close_s"), rc.get("ckpt_close_s"), "boto3 upload / objcache " + _ratio(
             c["multipart_put_s"], o.get("ckpt_close_s"))),
        ("checkpoint write until in S3 (s)", o.get("ckpt_in_s3_s"), f.get("ckpt_in_s3_s"),
         rc.get("ckpt_in_s3_s"), ""),
        ("peak daemon RSS (MB)", (o.get("peak_rss_bytes") or 0) / 1e6,
         (f.get("peak_rss_bytes") or 0) / 1e6, (rc.get("peak_rss_bytes") or 0) / 1e6, ""),
    ]
    lines = ["# Benchmarks against the peers (`python -m benchmarks.compare`)", "",
             "One run on one 2-vCPU machine, SeaweedFS on 127.0.0.1, "
             f"a {big_size // MiB} MiB file and {n_small} files of 16 KiB. Caches dropped "
             "(`drop_caches`) before cold and warm reads; cold numbers come from a fresh "
             "mount and cache.", "",
             "| Workload | objcache | s3fs-fuse | rclone mount | ratio |",
             "|---|---|---|---|---|"]
    for name, a, b, d, note in rows:
        cells = ["-" if v is None else f"{v:.3f}" for v in (a, b, d)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {note} |")
    lines += ["", "Ceilings: boto3 8 x 8 MiB ranged GETs "
              f"{gb / c['parallel_get_s']:.2f} GB/s; boto3 multipart PUT "
              f"{c['multipart_put_s']:.2f} s; boto3 16 threads over the small files "
              f"{n_small / c['small_get_s']:.0f} files/s; page-cache read "
              f"{gb / c['page_cache_read_s']:.2f} GB/s.", ""]
    if cl:
        lines += [f"3-node objcache cluster: cold read on node 0 {gb / cl['cold_s']:.2f} GB/s; "
                  f"node 1 reading what the cluster holds {gb / cl['peer_read_s']:.2f} GB/s "
                  f"(boto3 ceiling {gb / c['parallel_get_s']:.2f} GB/s); prefetch of the "
                  f"{n_small} small files {n_small / cl['prefetch_small_s']:.0f} files/s "
                  f"(boto3 16 threads {n_small / c['small_get_s']:.0f} files/s).", ""]
        if cl.get("drain_1024_s"):
            lines += [f"Drain of a node with 1024 dirty files (64 KiB each): "
                      f"{cl['drain_1024_s']:.1f} s until `objcache drain` returned, "
                      f"{cl.get('drain_in_s3')} of them in S3 then (IBM objcache reports "
                      "2-14 s). Peak RSS of the cluster's daemons: "
                      f"{(cl.get('peak_rss_bytes') or 0) / 1e6:.0f} MB.", ""]
    for name in ("objcache", "s3fs", "rclone"):
        if res.get(name, {}).get("error"):
            lines.append(f"{name} failed: {res[name]['error']}")
    if res.get("reads"):
        lines += ["## Model loading and big reads (`benchmarks.reads`)", "",
                  "A safetensors model of the big size (16 tensors), loaded with "
                  "`safetensors.torch.load_file` in a fresh process until every page has "
                  "reached memory, against downloading it with 8 x 8 MiB ranged GETs and "
                  "loading the local copy.", ""]
        lines += reads.report(res["reads"])
    if res.get("writes"):
        lines += ["## Checkpoints (`benchmarks.writes`)", "",
                  "`torch.save` of a state dict of the big size (16 tensors) in a fresh "
                  "process, against saving it to a local file on the cache disk and "
                  "uploading that with a boto3 multipart upload (8 threads, 16 MiB parts).",
                  ""]
        lines += writes.report(res["writes"])
    table = lines[:]
    lines += ["", "Raw figures:", "", "```", json.dumps(res, indent=1, default=str), "```", ""]
    (DOCS / "benchmarks-compare.md").write_text("\n".join(lines))
    # Every run's tables also go into the benchmark log (newest last).
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [f"### Run of {stamp} (`benchmarks.compare`)", ""]
    log_md = DOCS / "benchmarks.md"
    text = log_md.read_text()
    marker = "\n## Checkpoints"
    cut = text.index(marker) if marker in text else len(text)
    body = [ln.replace("## Model loading", "#### Model loading")
            .replace("## Checkpoints", "#### Checkpoints") for ln in table[2:]]
    log_md.write_text(text[:cut].rstrip("\n") + "\n\n" + "\n".join(head + body).rstrip()
                      + "\n" + text[cut:])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    labels = ["seq cold", "seq warm", "small cold", "small warm"]
    series = {n: [rate(res.get(n, {}), "seq_cold_s") or 0, rate(res.get(n, {}), "seq_warm_s")
                  or 0, (files(res.get(n, {}), "small_cold_s") or 0) / 1000,
                  (files(res.get(n, {}), "small_warm_s") or 0) / 1000]
              for n in ("objcache", "s3fs", "rclone")}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.25
    for i, (n, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], vals, width, label=n)
    ax.set_xticks([x + width for x in range(len(labels))], labels)
    ax.set_ylabel("GB/s (sequential) / thousand files/s (small)")
    ax.set_title("objcache vs s3fs-fuse vs rclone mount (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "benchmarks-compare.png", dpi=100)


if __name__ == "__main__":
    if len(os.sys.argv) == 3 and os.sys.argv[1] == "--report-from":
        # Re-render the report from the raw figures of an earlier run.
        text = Path(os.sys.argv[2]).read_text()
        raw = json.loads(text.split("```")[1])
        m = [ln for ln in text.splitlines() if ln.startswith("One run")][0]
        big = int(m.split("a ")[1].split(" MiB")[0]) * MiB
        n = int(m.split("and ")[1].split(" files")[0])
        write_report(raw, big, n)
    else:
        main()
