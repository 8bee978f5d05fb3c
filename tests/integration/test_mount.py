"""Single-node mount against a real SeaweedFS: caching, requests, crashes, restarts, the
commands. POSIX behaviour on one node and on a cluster is in test_posix.py."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.mount import Mount, is_mounted, objcache

MiB = 1 << 20
SMALL_CHUNKS = ("--chunk-size", "5M")


def wait_for(pred, timeout: float = 30, what: str = "condition"):  # type: ignore
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def s3_body(s3, bucket: str, key: str) -> bytes:  # type: ignore
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def s3_keys(s3, bucket: str) -> set[str]:  # type: ignore
    return {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])}


def gets(m: Mount) -> int:
    return int(m.status()["s3"]["requests"].get("get", 0))


def test_large_directory_lists_without_per_object_requests(s3, bucket, mount):  # type: ignore
    n = 1200
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=bucket, Key=f"many/f{i:05d}", Body=b"x"),
                      range(n)))
    m = mount()
    names = os.listdir(m.mnt / "many")
    assert sorted(names) == [f"f{i:05d}" for i in range(n)]
    st = m.status()["s3"]["requests"]
    assert st.get("head", 0) < 10, st  # LIST pages only, not one HEAD per entry
    assert st.get("list", 0) <= 6, st


def test_changed_object_is_not_served_stale(s3, bucket, mount):  # type: ignore
    s3.put_object(Bucket=bucket, Key="v.txt", Body=b"version one")
    m = mount("--metadata-ttl", "1")
    assert (m.mnt / "v.txt").read_bytes() == b"version one"
    s3.put_object(Bucket=bucket, Key="v.txt", Body=b"version two, longer")
    time.sleep(1.5)
    assert (m.mnt / "v.txt").read_bytes() == b"version two, longer"
    s3.delete_object(Bucket=bucket, Key="v.txt")
    time.sleep(1.5)
    assert not (m.mnt / "v.txt").exists()


def test_cache_survives_restart_and_concurrent_reads_share_gets(s3, bucket, mount,  # type: ignore
                                                                tmp_path):
    data = os.urandom(10 * MiB)
    s3.put_object(Bucket=bucket, Key="f.bin", Body=data)
    m = mount(*SMALL_CHUNKS, "--readahead", "5M")

    def read() -> bytes:
        return (m.mnt / "f.bin").read_bytes()
    with ThreadPoolExecutor(6) as pool:
        assert all(r == data for r in pool.map(lambda _: read(), range(6)))
    # Two 5 MiB chunks, fetched once each however many readers: 4 + 1 MiB ranged GETs.
    assert gets(m) == 4
    assert m.status()["cache"]["bytes_read_from_s3"] == len(data)
    objcache("umount", str(m.mnt))
    m2 = mount(*SMALL_CHUNKS, cache=m.cache, mnt=m.mnt)
    assert (m2.mnt / "f.bin").read_bytes() == data
    assert gets(m2) == 0
    st = m2.status()
    if st["fuse"]["mode"] == "passthrough":  # whole on the cache disk: the kernel read it
        assert st["fuse"]["passthrough_opens"] == 1 and st["fuse"]["daemon_read_bytes"] == 0
    else:
        assert st["cache"]["hit_ratio"] == 1.0


def test_cache_size_is_respected(s3, bucket, mount):  # type: ignore
    for i in range(4):
        s3.put_object(Bucket=bucket, Key=f"f{i}", Body=os.urandom(5 * MiB))
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M")
    for i in range(4):
        (m.mnt / f"f{i}").read_bytes()
        assert m.status()["cache"]["used_bytes"] <= 10 * MiB
    assert m.status()["cache"]["evictions"] >= 2


def test_checkpoints_bigger_than_the_cache_wait_for_write_back(s3, bucket, mount):  # type: ignore
    # Three 6 MiB checkpoints into a 10 MiB cache with a write-back delay of an hour: the
    # writes wait for uploads (the cache is crowded, so write-back starts at once), never ENOSPC.
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M", "--writeback-delay", "3600")
    files = {f"ckpt{i}.pt": os.urandom(6 * MiB) for i in range(3)}
    for name, data in files.items():
        with open(m.mnt / name, "wb") as f:
            for off in range(0, len(data), MiB):
                f.write(data[off:off + MiB])
    cache = m.status()["cache"]
    assert cache["write_waits"] >= 1 and cache["used_bytes"] <= 10 * MiB
    objcache("flush", str(m.mnt))
    for name, data in files.items():
        assert s3_body(s3, bucket, name) == data
        assert (m.mnt / name).read_bytes() == data


def test_a_file_that_can_never_fit_gives_enospc_at_once_and_loses_nothing(s3, bucket, mount):  # type: ignore
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M", "--writeback-delay", "3600")
    a = os.urandom(6 * MiB)
    (m.mnt / "a.bin").write_bytes(a)
    t0 = time.monotonic()
    with pytest.raises(OSError) as e, open(m.mnt / "b.bin", "wb") as f:
        for _ in range(12):
            f.write(os.urandom(MiB))
            f.flush()
    assert e.value.errno == errno.ENOSPC
    assert time.monotonic() - t0 < 20
    assert (m.mnt / "a.bin").read_bytes() == a
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "a.bin") == a


def test_fsync_uploads_before_returning(s3, bucket, mount):  # type: ignore
    m = mount("--writeback-delay", "3600")
    with open(m.mnt / "synced", "wb") as f:
        f.write(b"durable")
        f.flush()
        os.fsync(f.fileno())
        assert s3_body(s3, bucket, "synced") == b"durable"


def test_kill9_and_restart_loses_no_closed_file(s3, bucket, mount):  # type: ignore
    m = mount("--writeback-delay", "3600")
    files = {f"crash/f{i}": os.urandom(100_000 + i) for i in range(20)}
    (m.mnt / "crash").mkdir()
    for k, v in files.items():
        (m.mnt / k).write_bytes(v)
    assert m.status()["dirty"]["files"] == 20
    m.kill9()
    assert not any(k.startswith("crash/f") for k in s3_keys(s3, bucket))
    m2 = mount("--writeback-delay", "0.5", cache=m.cache, mnt=m.mnt)
    for k, v in files.items():
        assert (m2.mnt / k).read_bytes() == v
    wait_for(lambda: m2.status()["dirty"]["files"] == 0, what="uploads after restart")
    for k, v in files.items():
        assert s3_body(s3, bucket, k) == v


def _parts_in_s3(s3, bucket: str, key: str) -> int:  # type: ignore
    ups = [u for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
           if u["Key"] == key]
    return sum(len(s3.list_parts(Bucket=bucket, Key=key, UploadId=u["UploadId"])
                   .get("Parts", [])) for u in ups)


def test_a_sequential_writer_streams_to_s3_while_it_writes(s3, bucket, mount):  # type: ignore
    # 5 MiB chunks: 5 MiB parts. The write-back delay is an hour: only streaming uploads.
    m = mount(*SMALL_CHUNKS, "--writeback-delay", "3600")
    data = os.urandom(23 * MiB)
    with open(m.mnt / "ckpt.pt", "wb", buffering=0) as f:
        for off in range(0, 21 * MiB, MiB):
            f.write(data[off:off + MiB])
        wait_for(lambda: _parts_in_s3(s3, bucket, "ckpt.pt") >= 3, what="parts in S3")
        assert "ckpt.pt" not in s3_keys(s3, bucket)  # never an object while open
        f.write(data[21 * MiB:])
    wait_for(lambda: "ckpt.pt" in s3_keys(s3, bucket), what="the object after close")
    assert s3_body(s3, bucket, "ckpt.pt") == data
    wb = m.status()["writeback"]
    assert (wb["streamed_files"], wb["stream_fallbacks"]) == (1, 0)


def test_kill9_during_a_streamed_write_completes_nothing_and_keeps_closed_files(  # type: ignore
        s3, bucket, mount):
    m = mount(*SMALL_CHUNKS, "--writeback-delay", "3600")
    closed = os.urandom(3 * MiB)
    (m.mnt / "closed.bin").write_bytes(closed)
    f = open(m.mnt / "open.pt", "wb", buffering=0)  # noqa: SIM115
    try:
        for _ in range(16):
            f.write(os.urandom(MiB))
        wait_for(lambda: _parts_in_s3(s3, bucket, "open.pt") >= 2, what="parts in S3")
        m.kill9()
    finally:
        with pytest.raises(OSError):
            f.close()  # the mount is gone: this close is never acknowledged
    assert not {"open.pt", "closed.bin"} & s3_keys(s3, bucket)
    m2 = mount(*SMALL_CHUNKS, "--writeback-delay", "3600", cache=m.cache, mnt=m.mnt)
    objcache("flush", str(m2.mnt))
    assert s3_body(s3, bucket, "closed.bin") == closed


def test_umount_and_sigterm_flush(s3, bucket, mount, tmp_path):  # type: ignore
    m = mount("--writeback-delay", "3600")
    (m.mnt / "u.txt").write_bytes(b"umount me")
    objcache("umount", str(m.mnt))
    assert not is_mounted(m.mnt)
    assert m.wait_exit(30) == 0
    assert s3_body(s3, bucket, "u.txt") == b"umount me"
    m2 = mount("--writeback-delay", "3600", cache=m.cache, mnt=m.mnt)
    (m2.mnt / "t.txt").write_bytes(b"sigterm me")
    assert m2.proc is not None
    m2.proc.terminate()
    assert m2.wait_exit(60) == 0
    assert not is_mounted(m2.mnt)
    assert s3_body(s3, bucket, "t.txt") == b"sigterm me"


def test_background_mount_and_status(seaweed, bucket, tmp_path, mounts):  # type: ignore
    mnt, cache = tmp_path / "bg", tmp_path / "bgcache"
    mnt.mkdir()
    t0 = time.monotonic()
    objcache("mount", f"s3://{bucket}", str(mnt), "--endpoint-url", seaweed.endpoint,
             "--cache-dir", str(cache))
    m = Mount(seaweed.endpoint, bucket, mnt, cache)
    mounts.append(m)  # teardown unmounts it even if asserts fail
    assert is_mounted(mnt) and time.monotonic() - t0 < 20
    (mnt / "x").write_bytes(b"1")
    out = objcache("status", str(mnt)).stdout
    assert "dirty:" in out and "hit ratio" in out and "objcache-test" not in out
    st = json.loads(objcache("status", str(mnt), "--json").stdout)
    assert set(st) == set(m.status()) and st["pid"] == m.status()["pid"]
    assert st["cache"]["capacity_bytes"] == 10 << 30
    assert {"used_bytes", "hit_ratio"} <= set(st["cache"])
    assert {"files", "bytes", "oldest_age_seconds"} <= set(st["dirty"])
    pid = st["pid"]
    objcache("umount", str(mnt))
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="daemon exit")


def test_mmap_reads_each_byte_from_s3_once(s3, bucket, mount):  # type: ignore
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket=bucket, Key="m.bin", Body=data)
    m = mount("--writeback-delay", "3600")
    with open(m.mnt / "m.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[MiB:MiB + 4096] == data[MiB:MiB + 4096]
    # (the count is taken when the fetch ends, which may be after the page it brought in
    # was served)
    wait_for(lambda: m.status()["cache"]["bytes_read_from_s3"] >= len(data), timeout=10,
             what="the fetch to be counted")
    assert m.status()["cache"]["bytes_read_from_s3"] == len(data)
    with open(m.mnt / "open.txt", "w+b") as f:  # unlinked while open: never uploaded
        f.write(b"still here")
        f.flush()
        os.unlink(m.mnt / "open.txt")
    objcache("flush", str(m.mnt))
    assert "open.txt" not in s3_keys(s3, bucket)
    assert m.status()["dirty"]["files"] == 0


def test_signals_during_the_last_uploads_do_not_end_the_daemon(  # type: ignore
        s3, bucket, proxy, mounts, tmp_path):
    """A lazy unmount, then TERM and INT while the last upload is still stalled (what
    Mount.stop and an impatient operator do): the daemon finishes the upload and its
    close, and exits 0. Before, the first signal closed the signal receiver and the second
    got the default handler: killed mid-upload."""
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache",
              "--writeback-delay", "3600")
    mounts.append(m)
    m.start()
    assert m.proc is not None
    (m.mnt / "last.bin").write_bytes(b"the last words")
    proxy.stall_next("PUT", 2, 3.0)
    subprocess.run(["fusermount3", "-uz", str(m.mnt)], check=True)
    time.sleep(0.5)  # the daemon is uploading, the PUT held at the proxy
    m.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    m.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    m.proc.send_signal(signal.SIGTERM)
    assert m.wait_exit(60) == 0
    assert s3_body(s3, bucket, "last.bin") == b"the last words"
    assert "unmounted" in m.log_path.read_text()


def test_transient_s3_errors_are_retried(s3, bucket, proxy, mounts, tmp_path):  # type: ignore
    """503s injected by the proxy in front of SeaweedFS: uploads and reads still succeed."""
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache",
              "--writeback-delay", "0")
    mounts.append(m)
    m.start()
    written = os.urandom(3 << 20)
    (m.mnt / "out.bin").write_bytes(written)
    proxy.fail_next(8)  # more than one boto3 call's own attempts
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "out.bin") == written
    stored = os.urandom(2 << 20)
    s3.put_object(Bucket=bucket, Key="in.bin", Body=stored)
    proxy.fail_next(8)
    assert (m.mnt / "in.bin").read_bytes() == stored
    st = m.status()["s3"]
    assert sum(st["retries"].values()) >= 2, st
    assert not m.errors_in_log()


def test_bench_command(mount):  # type: ignore
    m = mount()
    r = objcache("bench", str(m.mnt), "--json", "--big-size", "8M", "--big-files", "2",
                 "--small-count", "40", "--small-size", "4K", "--threads", "2")
    res = json.loads(r.stdout)
    assert res["big_write"]["MBps"] > 0 and res["big_read"]["MBps"] > 0
    assert res["small_write"]["files_per_s"] > 0 and res["small_read"]["files_per_s"] > 0
    assert res["stat"]["ops_per_s"] > 0 and res["list"]["entries"] == 40
    assert [n for n in os.listdir(m.mnt) if n.startswith(".objcache-bench")] == []
    human = objcache("bench", str(m.mnt), "--big-size", "5M", "--small-count", "10").stdout
    assert "big file read" in human and "small file write" in human
    bad = objcache("bench", str(m.mnt / "missing"), check=False)
    assert bad.returncode == 1 and "is not a directory" in bad.stderr


def test_an_epoch_after_the_ttl_relists_instead_of_a_head_per_file(s3, bucket, mount):  # type: ignore
    names = [f"ds/{i:03d}.rec" for i in range(60)]
    for n in names:
        s3.put_object(Bucket=bucket, Key=n, Body=n.encode())
    m = mount("--metadata-ttl", "1")
    for n in names:  # epoch 1: a HEAD per file (its metadata), a LIST for the directory
        assert (m.mnt / n).read_bytes() == n.encode()
    before = m.status()["s3"]["requests"]
    time.sleep(1.5)  # every entry is stale now, in the kernel and here
    for n in names:  # epoch 2
        assert (m.mnt / n).read_bytes() == n.encode()
    after = m.status()["s3"]["requests"]
    heads = after.get("head", 0) - before.get("head", 0)
    lists = after.get("list", 0) - before.get("list", 0)
    assert heads <= 20 and lists >= 1, (heads, lists)  # was 60 HEADs
    # A changed object is still noticed.
    s3.put_object(Bucket=bucket, Key=names[-1], Body=b"changed")
    time.sleep(1.5)
    for n in names[:-1]:
        (m.mnt / n).read_bytes()
    assert (m.mnt / names[-1]).read_bytes() == b"changed"


def test_truncate_beyond_the_cache_is_sparse_and_efbig_beyond_s3(s3, bucket, mount):  # type: ignore
    """A preallocating truncate needs no cache space until written (10 MiB cache, 1 GiB
    file); beyond the largest uploadable object it gives EFBIG, not ENOSPC."""
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M", "--writeback-delay", "3600")
    with open(m.mnt / "pre.bin", "w+b") as f:
        os.ftruncate(f.fileno(), 1 << 30)
        os.pwrite(f.fileno(), b"middle", 512 * MiB)
        assert os.fstat(f.fileno()).st_size == 1 << 30
        assert os.pread(f.fileno(), 6, 512 * MiB) == b"middle"
        assert os.pread(f.fileno(), 4, 100 * MiB) == bytes(4)
    assert m.status()["cache"]["used_bytes"] <= 10 * MiB
    os.truncate(m.mnt / "pre.bin", 4096)  # (so that no test uploads a GiB of zeros)
    with pytest.raises(OSError) as e:
        os.truncate(m.mnt / "pre.bin", 10**15)
    assert e.value.errno == errno.EFBIG
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "pre.bin") == bytes(4096)


def test_a_key_s3_refuses_is_quarantined_and_umount_finishes(s3, bucket, proxy, tmp_path):  # type: ignore
    """S3 refuses one key for good (403 at the proxy): umount uploads everything else,
    unmounts, names the refused file and leaves its bytes in the cache dir's lost+found/."""
    proxy.refuse("bad.bin")
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache",
              "--writeback-delay", "3600").start()
    try:
        data = os.urandom(3 * MiB)
        (m.mnt / "good1").write_bytes(b"one")
        (m.mnt / "bad.bin").write_bytes(data)
        (m.mnt / "good2").write_bytes(b"two")
        t0 = time.monotonic()
        r = objcache("umount", str(m.mnt), check=False, timeout=60)
        assert r.returncode != 0 and "bad.bin" in r.stderr and "lost+found" in r.stderr, r
        assert m.wait_exit(30) == 0
        assert time.monotonic() - t0 < 30
    finally:
        m.stop()
    assert s3_body(s3, bucket, "good1") == b"one" and s3_body(s3, bucket, "good2") == b"two"
    assert "bad.bin" not in {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    notes = list((tmp_path / "cache" / "lost+found").glob("*.json"))
    assert len(notes) == 1
    note = json.loads(notes[0].read_text())
    assert note["key"] == "bad.bin" and "AccessDenied" in note["error"]
    assert (notes[0].parent / note["data"]).read_bytes() == data


def test_a_list_cut_short_is_retried_not_eio(s3, bucket, proxy, tmp_path):  # type: ignore
    """A LIST whose body ends early (it does not parse) is a transient failure: retried,
    never EIO in opendir or lookup."""
    for i in range(5):
        s3.put_object(Bucket=bucket, Key=f"d/f{i}", Body=b"x")
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache").start()
    try:
        proxy.reset()
        proxy.short_next("LIST", 2)
        assert sorted(os.listdir(m.mnt / "d")) == [f"f{i}" for i in range(5)]
        assert proxy.requests["LIST"] >= 3
        assert m.status()["s3"]["retries"].get("list", 0) >= 1
    finally:
        m.stop()


def test_a_stalled_get_leaves_room_for_more_attempts(s3, bucket, proxy, tmp_path):  # type: ignore
    """A GET that stalls is abandoned after a per-attempt timeout that leaves room for
    several attempts in --s3-retry-seconds, instead of using up the budget on one."""
    data = os.urandom(MiB)
    s3.put_object(Bucket=bucket, Key="slow.bin", Body=data)
    cfg = tmp_path / "objcache.toml"
    cfg.write_text("s3-retry-seconds = 12\n")
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache",
              "--config", str(cfg)).start()
    try:
        os.stat(m.mnt / "slow.bin")
        proxy.stall_next("GET_OBJECT", 1, 40)
        t0 = time.monotonic()
        assert (m.mnt / "slow.bin").read_bytes() == data
        assert time.monotonic() - t0 < 12
    finally:
        m.stop()


@pytest.fixture
def small_disk(tmp_path):  # type: ignore
    """A 96 MiB tmpfs as the cache dir's filesystem (needs root: skipped otherwise)."""
    path = tmp_path / "small"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_cache_disk_smaller_than_cache_size_evicts_instead_of_failing(
        s3, bucket, mount, small_disk):  # type: ignore
    """--cache-size 1G on a 96 MiB disk: the cache holds what the disk can (less a
    reserve for its database), evicts clean chunks for writes, and never fails a write or
    a close with ENOSPC/EIO; after a restart it still works."""
    for i in range(16):
        s3.put_object(Bucket=bucket, Key=f"r{i}", Body=os.urandom(5 * MiB))
    m = mount(*SMALL_CHUNKS, "--cache-size", "1G", cache=small_disk / "c")
    assert m.status()["cache"]["capacity_bytes"] < 96 * MiB
    for i in range(16):
        (m.mnt / f"r{i}").read_bytes()
    data = os.urandom(32 * MiB)
    (m.mnt / "w.bin").write_bytes(data)
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "w.bin") == data
    assert m.status()["dirty"]["files"] == 0
    assert not m.errors_in_log()
    m.stop()
    m2 = mount(*SMALL_CHUNKS, "--cache-size", "1G", cache=small_disk / "c", mnt=m.mnt)
    assert m2.status()["dirty"]["files"] == 0
    (m2.mnt / "w2.bin").write_bytes(data)
    objcache("flush", str(m2.mnt))
    assert s3_body(s3, bucket, "w2.bin") == data


INTERRUPTED_STAT = """
import os, signal, sys, time
class Alarm(Exception):
    pass
def ring(signum, frame):
    raise Alarm
signal.signal(signal.SIGALRM, ring)
signal.setitimer(signal.ITIMER_REAL, 0.5)
t = time.monotonic()
try:
    os.stat(sys.argv[1])
    print("done", time.monotonic() - t)
except Alarm:
    print("interrupted", time.monotonic() - t)
"""


def test_a_signal_interrupts_a_request_waiting_on_s3(s3, bucket, proxy, mounts, tmp_path):  # type: ignore
    """A stat held up by S3 is cut short by a signal (FUSE_INTERRUPT: the daemon cancels
    the lookup and answers EINTR), instead of the caller sitting out the slow request."""
    s3.put_object(Bucket=bucket, Key="slow.bin", Body=b"x")
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache")
    mounts.append(m)
    m.start()
    proxy.stall_next("HEAD", 4, 4.0)
    r = subprocess.run([sys.executable, "-c", INTERRUPTED_STAT, str(m.mnt / "slow.bin")],
                       capture_output=True, text=True, timeout=30)
    what, secs = r.stdout.split()
    assert what == "interrupted" and float(secs) < 2.0, r.stdout + r.stderr
    assert (m.mnt / "slow.bin").read_bytes() == b"x"  # and the mount goes on
