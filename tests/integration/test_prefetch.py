"""`objcache prefetch / unpin / evict` on a cluster of daemons against SeaweedFS, with the
S3 traffic counted by a proxy: warmed data is read with zero GETs, a second run fetches
nothing, an interrupted run resumes, a missing path fails alone, pinned data survives
cache pressure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tests.helpers.mount import env, objcache

MIB = 1 << 20


def _upload(s3, bucket: str, objects: dict[str, bytes]) -> None:  # type: ignore
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                      objects.items()))


def _prefetch(*args: str, check: bool = True) -> tuple[int, dict]:  # type: ignore
    r = objcache("prefetch", "--json", *args, check=False, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr + r.stdout
    return r.returncode, json.loads(r.stdout)


def _read_tree(root: os.PathLike[str], expected: dict[str, bytes], prefix: str) -> None:
    for key, body in expected.items():
        with open(os.path.join(root, key[len(prefix):]), "rb") as f:
            assert f.read() == body, key


def test_prefetch_warms_the_cluster_once(s3, bucket, cluster, proxy):  # type: ignore
    small = {f"ds/train/{i:04d}.rec": os.urandom(16 * 1024) for i in range(300)}
    big = {"ds/model.bin": os.urandom(40 * MIB)}
    _upload(s3, bucket, {**small, **big})
    nodes = [cluster.add("--chunk-size", "8M") for _ in range(2)]
    cluster.wait_members(nodes, 2)
    total = sum(map(len, small.values())) + 40 * MIB
    proxy.reset()

    _, out = _prefetch(str(nodes[0].mnt / "ds"))
    assert out["files"] == 301 and out["bytes"] == total and not out["failures"], out
    assert out["bytes_fetched"] == total and out["bytes_cached_before"] == 0
    # Every chunk was fetched once, by its owner: both nodes fetched some. (A request to
    # a peer that misses heartbeats under load falls back to fetching here: a chunk or
    # two may be fetched twice, never the data set.)
    assert total <= proxy.get_object_bytes <= total + 8 * MIB
    assert all(n.status()["cache"]["bytes_read_from_s3"] > 0 for n in nodes)

    # Reading everything, through either node, makes no GET.
    proxy.reset()
    for n in nodes:
        _read_tree(n.mnt, {**small, **big}, "")
    assert proxy.requests["GET_OBJECT"] == 0, proxy.requests

    # A second run fetches nothing.
    _, again = _prefetch(str(nodes[1].mnt / "ds"))
    assert again["bytes_fetched"] == 0 and again["bytes_cached_before"] == total, again
    assert proxy.requests["GET_OBJECT"] == 0


def test_missing_paths_fail_alone_and_globs_and_manifests_work(  # type: ignore
        s3, bucket, cluster, proxy, tmp_path):
    files = {f"d/f{i}.bin": os.urandom(100_000) for i in range(5)}
    _upload(s3, bucket, files)
    (node,) = [cluster.add("--chunk-size", "8M")]
    mnt = node.mnt
    code, out = _prefetch(str(mnt / "d" / "f0.bin"), str(mnt / "nope"),
                          str(mnt / "d" / "f[12].bin"), check=False)
    assert code == 1
    assert [f["path"] for f in out["failures"]] == [str(mnt / "nope")], out
    assert "no such file" in out["failures"][0]["error"]
    assert out["files"] == 3 and out["bytes_fetched"] == 300_000
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("# the rest\n" + "".join(f"{mnt}/d/f{i}.bin\n" for i in range(5)))
    _, out = _prefetch("--manifest", str(manifest))
    assert out["files"] == 5 and out["bytes_fetched"] == 200_000
    assert out["bytes_cached_before"] == 300_000
    # The human form: one summary line on stdout, failures on stderr, exit 1.
    r = objcache("prefetch", str(mnt / "missing"), check=False)
    assert r.returncode == 1 and "missing: no such file" in r.stderr


def test_interrupted_prefetch_resumes(s3, bucket, cluster, proxy):  # type: ignore
    files = {f"big/{i:02d}.bin": os.urandom(8 * MIB) for i in range(24)}
    _upload(s3, bucket, files)
    (node,) = [cluster.add("--chunk-size", "8M")]
    total = 24 * 8 * MIB
    proxy.reset()
    # Each GET held 1.5 s: the prefetch cannot finish before the interrupt reaches it,
    # however loaded the machine (with 0.3 s it did, twice, in CI).
    proxy.stall_next("GET_OBJECT", 24, 1.5)
    proc = subprocess.Popen([sys.executable, "-m", "objcache", "prefetch", "--jobs", "1",
                             str(node.mnt / "big")], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            # a suite started in the background (CI) has SIGINT ignored,
                            # and children inherit that: Ctrl-C as a terminal sends it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while proxy.requests["GET_OBJECT"] < 3:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    first = -1
    while first != proxy.get_object_bytes:  # the daemon finishes the batch in flight
        first = proxy.get_object_bytes
        time.sleep(1)
    assert 0 < first < total, first

    _, out = _prefetch(str(node.mnt / "big"))
    # What the first run got is not fetched again.
    assert out["bytes_cached_before"] >= first - 8 * MIB
    assert out["bytes_cached_before"] + out["bytes_fetched"] == total
    assert proxy.get_object_bytes <= total + 8 * MIB


def test_pinned_data_survives_cache_pressure(s3, bucket, cluster, proxy):  # type: ignore
    keep = os.urandom(24 * MIB)
    _upload(s3, bucket, {"keep/weights.bin": keep,
                         **{f"churn/{i}.bin": os.urandom(16 * MIB) for i in range(6)},
                         "huge/too-big.bin": os.urandom(48 * MIB)})
    node = cluster.add("--chunk-size", "8M", "--cache-size", "64M")
    mnt = node.mnt
    _, out = _prefetch("--pin", str(mnt / "keep"))
    assert out["pinned"] and out["bytes_fetched"] == 24 * MIB
    assert node.status()["cache"]["pinned_bytes"] == 24 * MIB

    for i in range(6):  # 96 MiB through a 64 MiB cache
        (mnt / "churn" / f"{i}.bin").read_bytes()
    proxy.reset()
    fd = os.open(mnt / "keep" / "weights.bin", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # make the read reach the daemon
    os.close(fd)
    assert (mnt / "keep" / "weights.bin").read_bytes() == keep
    assert proxy.requests["GET_OBJECT"] == 0, proxy.requests

    # Pinning more than fits (40 MiB left) fails clearly and keeps what is pinned.
    code, out = _prefetch("--pin", str(mnt / "huge"), check=False)
    assert code == 1 and "pinned" in out["failures"][0]["error"], out
    assert node.status()["cache"]["pinned_bytes"] >= 24 * MIB

    r = objcache("unpin", str(mnt / "keep"), str(mnt / "huge"))
    assert "unpinned" in r.stdout
    assert node.status()["cache"]["pinned_bytes"] == 0
    r = objcache("evict", str(mnt))
    assert node.status()["cache"]["chunks"] == 0, r.stdout
