"""Single-node mount against a real SeaweedFS: reads, writes, namespace, caching, crashes."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
import subprocess
import threading
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


def test_reads_are_byte_exact(s3, bucket, mount):  # type: ignore
    big = os.urandom(12 * MiB + 12345)  # three 5 MiB chunks, the last one partial
    files = {"small.txt": b"hello\n", "empty": b"", "big.bin": big,
             "a/b/c/nested.txt": b"deep" * 1000}
    for k, v in files.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    m = mount(*SMALL_CHUNKS)
    for k, v in files.items():
        assert (m.mnt / k).read_bytes() == v, k
        assert (m.mnt / k).stat().st_size == len(v)
    # Random-offset reads across chunk boundaries.
    with open(m.mnt / "big.bin", "rb") as f:
        for off in (0, 5 * MiB - 3, 10 * MiB - 1, len(big) - 10, 7 * MiB + 11):
            f.seek(off)
            assert f.read(100_000) == big[off:off + 100_000]
    assert sorted(os.listdir(m.mnt)) == ["a", "big.bin", "empty", "small.txt"]
    assert (m.mnt / "a").is_dir() and (m.mnt / "a/b/c").is_dir()
    assert not m.errors_in_log()


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


def test_writes_reach_s3_with_attributes(s3, bucket, mount):  # type: ignore
    m = mount("--writeback-delay", "0.2")
    data = os.urandom(3 * MiB)
    (m.mnt / "w.bin").write_bytes(data)
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "x.txt").write_text("x")
    os.chmod(m.mnt / "w.bin", 0o640)
    os.symlink("w.bin", m.mnt / "ln")
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "w.bin") == data
    meta = s3.head_object(Bucket=bucket, Key="w.bin")["Metadata"]
    assert int(meta["mode"]) == stat.S_IFREG | 0o640
    assert "d/" in s3_keys(s3, bucket)
    ln = s3.head_object(Bucket=bucket, Key="ln")
    assert stat.S_ISLNK(int(ln["Metadata"]["mode"]))
    assert s3_body(s3, bucket, "ln") == b"w.bin"
    # chmod of a clean file is a server-side metadata rewrite.
    os.chmod(m.mnt / "d" / "x.txt", 0o600)
    assert int(s3.head_object(Bucket=bucket, Key="d/x.txt")["Metadata"]["mode"]) & 0o777 \
        == 0o600
    st = m.status()
    assert st["dirty"]["files"] == 0


def test_s3fs_metadata_is_honoured(s3, bucket, mount):  # type: ignore
    s3.put_object(Bucket=bucket, Key="exe", Body=b"#!/bin/sh\n",
                  Metadata={"mode": str(stat.S_IFREG | 0o751), "uid": "1234", "gid": "4321",
                            "mtime": "1600000000"})
    s3.put_object(Bucket=bucket, Key="link", Body=b"exe",
                  Metadata={"mode": str(stat.S_IFLNK | 0o777)})
    s3.put_object(Bucket=bucket, Key="plain", Body=b"p")
    m = mount()
    st = os.stat(m.mnt / "exe")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)) == \
        (0o751, 1234, 4321, 1600000000)
    assert os.readlink(m.mnt / "link") == "exe"
    assert (m.mnt / "link").read_bytes() == b"#!/bin/sh\n"
    assert stat.S_IMODE(os.stat(m.mnt / "plain").st_mode) == 0o644


def test_rename_unlink_and_directory_rename(s3, bucket, mount):  # type: ignore
    s3.put_object(Bucket=bucket, Key="clean.txt", Body=b"clean")
    for i in range(5):
        s3.put_object(Bucket=bucket, Key=f"dir/sub/f{i}", Body=f"{i}".encode())
    m = mount("--writeback-delay", "3600")
    os.rename(m.mnt / "clean.txt", m.mnt / "moved.txt")  # clean: server-side copy
    assert "moved.txt" in s3_keys(s3, bucket) and "clean.txt" not in s3_keys(s3, bucket)
    (m.mnt / "dirty.txt").write_bytes(b"dirty data")
    os.rename(m.mnt / "dirty.txt", m.mnt / "dirty2.txt")  # dirty: re-keyed locally
    assert (m.mnt / "dirty2.txt").read_bytes() == b"dirty data"
    (m.mnt / "dir" / "sub" / "new").write_bytes(b"new")
    os.rename(m.mnt / "dir", m.mnt / "dir2")
    assert sorted(os.listdir(m.mnt / "dir2" / "sub")) == ["f0", "f1", "f2", "f3", "f4", "new"]
    assert not (m.mnt / "dir").exists()
    os.unlink(m.mnt / "moved.txt")
    objcache("flush", str(m.mnt))
    keys = s3_keys(s3, bucket)
    assert {"dirty2.txt", "dir2/sub/new", *{f"dir2/sub/f{i}" for i in range(5)}} <= keys
    assert not {k for k in keys if k.startswith("dir/") or k in ("moved.txt", "dirty.txt")}
    assert s3_body(s3, bucket, "dir2/sub/f3") == b"3"
    with pytest.raises(OSError) as e:
        os.rmdir(m.mnt / "dir2")
    assert e.value.errno == errno.ENOTEMPTY


def test_random_writes_and_truncate_on_existing_object(s3, bucket, mount):  # type: ignore
    base = bytearray(os.urandom(11 * MiB))
    s3.put_object(Bucket=bucket, Key="rw.bin", Body=bytes(base))
    m = mount(*SMALL_CHUNKS, "--writeback-delay", "3600")
    with open(m.mnt / "rw.bin", "r+b") as f:
        f.seek(6 * MiB + 7)
        f.write(b"PATCH")
        f.seek(100)
        f.write(b"HEAD")
    base[6 * MiB + 7:6 * MiB + 12] = b"PATCH"
    base[100:104] = b"HEAD"
    assert (m.mnt / "rw.bin").read_bytes() == bytes(base)
    os.truncate(m.mnt / "rw.bin", 7 * MiB)
    os.truncate(m.mnt / "rw.bin", 8 * MiB)  # the regrown tail must be zeros, not old data
    expect = bytes(base[:7 * MiB]) + bytes(MiB)
    assert (m.mnt / "rw.bin").read_bytes() == expect
    objcache("flush", str(m.mnt))
    assert s3_body(s3, bucket, "rw.bin") == expect


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
    assert gets(m) == 2  # two chunks, fetched once each however many readers
    objcache("umount", str(m.mnt))
    m2 = mount(*SMALL_CHUNKS, cache=m.cache, mnt=m.mnt)
    assert (m2.mnt / "f.bin").read_bytes() == data
    assert gets(m2) == 0
    assert m2.status()["cache"]["hit_ratio"] == 1.0


def test_cache_size_is_respected(s3, bucket, mount):  # type: ignore
    for i in range(4):
        s3.put_object(Bucket=bucket, Key=f"f{i}", Body=os.urandom(5 * MiB))
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M")
    for i in range(4):
        (m.mnt / f"f{i}").read_bytes()
        assert m.status()["cache"]["used_bytes"] <= 10 * MiB
    assert m.status()["cache"]["evictions"] >= 2


def test_full_cache_gives_enospc_and_loses_nothing(s3, bucket, mount):  # type: ignore
    m = mount(*SMALL_CHUNKS, "--cache-size", "10M", "--writeback-delay", "3600")
    a = os.urandom(6 * MiB)
    (m.mnt / "a.bin").write_bytes(a)
    with pytest.raises(OSError) as e, open(m.mnt / "b.bin", "wb") as f:
        for _ in range(10):
            f.write(os.urandom(MiB))
            f.flush()
    assert e.value.errno == errno.ENOSPC
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
    st = m.status()
    assert st["cache"]["capacity_bytes"] == 10 << 30
    assert {"used_bytes", "hit_ratio"} <= set(st["cache"])
    assert {"files", "bytes", "oldest_age_seconds"} <= set(st["dirty"])
    pid = st["pid"]
    objcache("umount", str(mnt))
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what="daemon exit")


def test_concurrent_writers_and_readers(s3, bucket, mount):  # type: ignore
    m = mount("--writeback-delay", "0.3")
    payloads = {f"p{i}": os.urandom(256 * 1024) for i in range(16)}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            (m.mnt / name).write_bytes(payloads[name])
            assert (m.mnt / name).read_bytes() == payloads[name]
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=work, args=(n,)) for n in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    objcache("flush", str(m.mnt))
    for k, v in payloads.items():
        assert hashlib.sha256(s3_body(s3, bucket, k)).digest() == hashlib.sha256(v).digest()
    assert not m.errors_in_log()


def test_cp_and_checksum_tools_work(s3, bucket, mount, tmp_path):  # type: ignore
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(7 * MiB))
    m = mount(*SMALL_CHUNKS)
    subprocess.run(["cp", str(src), str(m.mnt / "copy.bin")], check=True)
    a = subprocess.run(["sha256sum", str(src)], capture_output=True, text=True).stdout.split()[0]
    b = subprocess.run(["sha256sum", str(m.mnt / "copy.bin")], capture_output=True,
                       text=True).stdout.split()[0]
    assert a == b


def test_mmap_and_unlink_of_an_open_file(s3, bucket, mount):  # type: ignore
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket=bucket, Key="m.bin", Body=data)
    m = mount("--writeback-delay", "3600")
    with open(m.mnt / "m.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[MiB:MiB + 4096] == data[MiB:MiB + 4096]
    assert m.status()["cache"]["bytes_read_from_s3"] == len(data)
    with open(m.mnt / "open.txt", "w+b") as f:
        f.write(b"still here")
        f.flush()
        os.unlink(m.mnt / "open.txt")
        assert not (m.mnt / "open.txt").exists()
        f.seek(0)
        assert f.read() == b"still here"
    objcache("flush", str(m.mnt))
    assert "open.txt" not in s3_keys(s3, bucket)
    assert m.status()["dirty"]["files"] == 0


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
