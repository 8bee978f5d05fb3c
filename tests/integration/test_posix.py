"""POSIX behaviour through real FUSE mounts, the same tests on one node and on a 2-node
cluster.

The mounts are shared by the tests of a mode (starting daemons is the slow part); each test
works in a directory of its own, `place.a` through the first node and `place.b` through the
second (the same node when there is one), with its S3 keys under `place.prefix`. In a
cluster, what a test writes through A it reads back through B, so every case also checks
that a change is seen on the other node.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import mmap
import os
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import fuse_available
from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache, stop_all
from tests.helpers.seaweed import SeaweedFS

MiB = 1 << 20
FLAGS = ("--chunk-size", "5M", "--writeback-delay", "3600")
# Tests' directories are spread over a few parents made before the mounts look: a parent
# in which 16 names were looked up one by one gets listed, and then a directory another
# client makes there is only seen after --metadata-ttl (docs/semantics.md).
GROUPS = 8
_places = itertools.count()


@dataclass
class Mode:
    name: str
    a: Mount
    b: Mount
    s3: Any
    bucket: str


@dataclass
class Place:
    """A test's own directory in the shared mounts."""

    mode: Mode
    prefix: str
    a: Path
    b: Path
    logs: list[tuple[Mount, int]]

    @property
    def s3(self) -> Any:
        return self.mode.s3

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def put(self, name: str, body: bytes, **kw: Any) -> None:
        self.s3.put_object(Bucket=self.mode.bucket, Key=self.key(name), Body=body, **kw)

    def body(self, name: str) -> bytes:
        return bytes(self.s3.get_object(Bucket=self.mode.bucket,
                                        Key=self.key(name))["Body"].read())

    def head(self, name: str) -> dict[str, Any]:
        return dict(self.s3.head_object(Bucket=self.mode.bucket, Key=self.key(name)))

    def s3_keys(self) -> set[str]:
        out = set()
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.mode.bucket, Prefix=self.prefix + "/")
        for page in pages:
            out |= {o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])}
        return out

    def flush(self, path: Path | None = None) -> None:
        objcache("flush", str(path or self.a))

    def errors(self) -> list[str]:
        out = []
        for m, start in self.logs:
            text = m.log_path.read_bytes()[start:].decode(errors="replace")
            out += [ln for ln in text.splitlines() if " ERROR " in ln or "Traceback" in ln]
        return out


def _log_size(m: Mount) -> int:
    return m.log_path.stat().st_size if m.log_path.exists() else 0


@pytest.fixture(scope="module", params=["single", "cluster"])
def mode(request: pytest.FixtureRequest, seaweed: SeaweedFS,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mode]:
    if not fuse_available():
        pytest.skip("needs /dev/fuse and fusermount3")
    s3 = seaweed.client()
    bucket = f"posix-{request.param}-{os.getpid()}"
    s3.create_bucket(Bucket=bucket)
    for g in range(GROUPS):
        s3.put_object(Bucket=bucket, Key=f"g{g}/", Body=b"")
    root = tmp_path_factory.mktemp(f"posix-{request.param}")
    mounts: list[Mount] = []
    try:
        if request.param == "single":
            a = Mount(seaweed.endpoint, bucket, root / "mnt", root / "cache", *FLAGS)
            mounts.append(a)
            a.start()
            b = a
        else:
            cluster = Cluster(seaweed.endpoint, bucket, root, mounts)
            a = cluster.add(*FLAGS)
            b = cluster.add(*FLAGS)
            cluster.wait_raft([a, b], 2)
        yield Mode(request.param, a, b, s3, bucket)
    finally:
        stop_all(mounts)


def gone(path: Path, timeout: float = 2.0) -> bool:
    """Whether `path` disappears within `timeout`: another node drops a removed name from
    its kernel as soon as it applies the change (milliseconds), not at once."""
    deadline = time.monotonic() + timeout
    while os.path.lexists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def seen(check: Any, timeout: float = 2.0) -> Any:
    """`check()` once it holds, within `timeout`: another node shows new attributes once
    it has applied the change and told its kernel (milliseconds; an open is exact)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            return got
        time.sleep(0.02)


@pytest.fixture
def place(mode: Mode) -> Place:
    # The directory is made in S3 (as by another client), so objects a test puts there
    # before its first look are seen (a directory listed through the mount shows other
    # clients' changes after --metadata-ttl).
    sub = f"g{next(_places) % GROUPS}/t-{uuid.uuid4().hex[:8]}"
    mode.s3.put_object(Bucket=mode.bucket, Key=sub + "/", Body=b"")
    logs = [(m, _log_size(m)) for m in {id(mode.a): mode.a, id(mode.b): mode.b}.values()]
    return Place(mode, sub, mode.a.mnt / sub, mode.b.mnt / sub, logs)


def test_reads_are_byte_exact(place: Place) -> None:
    big = os.urandom(12 * MiB + 12345)  # three 5 MiB chunks, the last one partial
    files = {"small.txt": b"hello\n", "empty": b"", "big.bin": big,
             "a/b/c/nested.txt": b"deep" * 1000}
    for k, v in files.items():
        place.put(k, v)
    for root in (place.a, place.b):
        for k, v in files.items():
            assert (root / k).read_bytes() == v, k
            assert (root / k).stat().st_size == len(v)
        with open(root / "big.bin", "rb") as f:  # random offsets across chunk boundaries
            for off in (0, 5 * MiB - 3, 10 * MiB - 1, len(big) - 10, 7 * MiB + 11):
                f.seek(off)
                assert f.read(100_000) == big[off:off + 100_000]
        assert sorted(os.listdir(root)) == ["a", "big.bin", "empty", "small.txt"]
        assert (root / "a").is_dir() and (root / "a/b/c").is_dir()
    assert not place.errors()


def test_writes_reach_s3_with_attributes(place: Place) -> None:
    data = os.urandom(3 * MiB)
    (place.a / "w.bin").write_bytes(data)
    (place.a / "d").mkdir()
    (place.a / "d" / "x.txt").write_text("x")
    os.chmod(place.a / "w.bin", 0o640)
    os.symlink("w.bin", place.a / "ln")
    assert seen(lambda: stat.S_IMODE(os.stat(place.b / "w.bin").st_mode) == 0o640)
    assert os.readlink(place.b / "ln") == "w.bin"
    assert (place.b / "ln").read_bytes() == data
    place.flush()
    assert place.body("w.bin") == data
    assert int(place.head("w.bin")["Metadata"]["mode"]) == stat.S_IFREG | 0o640
    assert "d/" in place.s3_keys()
    assert stat.S_ISLNK(int(place.head("ln")["Metadata"]["mode"]))
    assert place.body("ln") == b"w.bin"
    # chmod of a clean file: its metadata is rewritten in S3 (at once on one node, at
    # write-back in a cluster).
    os.chmod(place.a / "d" / "x.txt", 0o600)
    assert seen(lambda: stat.S_IMODE(os.stat(place.b / "d" / "x.txt").st_mode) == 0o600)
    place.flush()
    assert int(place.head("d/x.txt")["Metadata"]["mode"]) & 0o777 == 0o600
    assert (place.b / "d" / "x.txt").read_text() == "x"
    assert not place.errors()


def test_s3fs_metadata_is_honoured(place: Place) -> None:
    place.put("exe", b"#!/bin/sh\n", Metadata={"mode": str(stat.S_IFREG | 0o751),
                                                "uid": "1234", "gid": "4321",
                                                "mtime": "1600000000"})
    place.put("link", b"exe", Metadata={"mode": str(stat.S_IFLNK | 0o777)})
    place.put("plain", b"p")
    for root in (place.a, place.b):
        st = os.stat(root / "exe")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)) == \
            (0o751, 1234, 4321, 1600000000)
        assert os.readlink(root / "link") == "exe"
        assert (root / "link").read_bytes() == b"#!/bin/sh\n"
        assert stat.S_IMODE(os.stat(root / "plain").st_mode) == 0o644


def test_rename_unlink_and_directory_rename(place: Place) -> None:
    place.put("clean.txt", b"clean")
    for i in range(5):
        place.put(f"dir/sub/f{i}", f"{i}".encode())
    a, b = place.a, place.b
    os.rename(a / "clean.txt", a / "moved.txt")
    assert (b / "moved.txt").read_bytes() == b"clean"
    assert gone(b / "clean.txt")
    (a / "dirty.txt").write_bytes(b"dirty data")
    os.rename(a / "dirty.txt", a / "dirty2.txt")
    assert (b / "dirty2.txt").read_bytes() == b"dirty data"
    (a / "dir" / "sub" / "new").write_bytes(b"new")
    os.rename(a / "dir", a / "dir2")
    assert sorted(os.listdir(b / "dir2" / "sub")) == ["f0", "f1", "f2", "f3", "f4", "new"]
    assert gone(b / "dir")
    os.unlink(a / "moved.txt")
    assert gone(b / "moved.txt")
    place.flush()
    keys = place.s3_keys()
    assert {"dirty2.txt", "dir2/sub/new", *{f"dir2/sub/f{i}" for i in range(5)}} <= keys
    assert not {k for k in keys if k.startswith("dir/") or k in ("moved.txt", "dirty.txt",
                                                                 "clean.txt")}
    assert place.body("dir2/sub/f3") == b"3"
    with pytest.raises(OSError) as e:
        os.rmdir(b / "dir2")
    assert e.value.errno == errno.ENOTEMPTY
    assert not place.errors()


def test_random_writes_and_truncate_on_existing_object(place: Place) -> None:
    base = bytearray(os.urandom(11 * MiB))
    place.put("rw.bin", bytes(base))
    with open(place.a / "rw.bin", "r+b") as f:
        f.seek(6 * MiB + 7)
        f.write(b"PATCH")
        f.seek(100)
        f.write(b"HEAD")
    base[6 * MiB + 7:6 * MiB + 12] = b"PATCH"
    base[100:104] = b"HEAD"
    assert (place.b / "rw.bin").read_bytes() == bytes(base)
    os.truncate(place.a / "rw.bin", 7 * MiB)
    os.truncate(place.a / "rw.bin", 8 * MiB)  # the regrown tail must be zeros, not old data
    expect = bytes(base[:7 * MiB]) + bytes(MiB)
    assert (place.b / "rw.bin").read_bytes() == expect
    place.flush()
    assert place.body("rw.bin") == expect


def test_open_with_o_trunc_and_no_write_empties_the_file(place: Place) -> None:
    """O_TRUNC then close() with nothing written (also `: > file`): the file is empty on
    every node, in S3 after write-back, and its mtime moved."""
    for name in ("t1", "t2"):
        (place.a / name).write_bytes(b"old bytes")
        os.utime(place.a / name, (1_000_000_000, 1_000_000_000))
    before = time.time() - 1
    fd = os.open(place.b / "t1", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    subprocess.run(["sh", "-c", f": > '{place.b / 't2'}'"], check=True)
    for name in ("t1", "t2"):
        for root in (place.a, place.b):
            st = os.stat(root / name)
            assert st.st_size == 0, (name, root)
            assert (root / name).read_bytes() == b""
            assert st.st_mtime >= before and st.st_ctime >= before, (name, st)
    place.flush()
    assert place.body("t1") == b"" and place.body("t2") == b""


def test_truncate_and_ftruncate_update_times(place: Place) -> None:
    (place.a / "f").write_bytes(b"0123456789")
    os.utime(place.a / "f", (1_000_000_000, 1_000_000_000))
    before = time.time() - 1
    os.truncate(place.a / "f", 4)
    for root in (place.a, place.b):
        st = seen(lambda root=root: (s := os.stat(root / "f")).st_size == 4 and s)
        assert st.st_size == 4 and st.st_mtime >= before and st.st_ctime >= before, st
    os.utime(place.a / "f", (1_000_000_000, 1_000_000_000))
    with open(place.a / "f", "r+b") as f:
        os.ftruncate(f.fileno(), 2)
        st = os.fstat(f.fileno())
        assert st.st_size == 2 and st.st_mtime >= before, st
    st = seen(lambda: (s := os.stat(place.b / "f")).st_size == 2 and s)
    assert st.st_size == 2 and st.st_mtime >= before and st.st_ctime >= before, st
    assert (place.b / "f").read_bytes() == b"01"


def test_unlink_of_an_open_dirty_file_keeps_its_data(place: Place) -> None:
    """POSIX: an open descriptor keeps an unlinked file's data until the last close."""
    with open(place.a / "open.txt", "w+b") as f:
        f.write(b"Hello")
        f.flush()
        os.unlink(place.a / "open.txt")
        assert not (place.a / "open.txt").exists()
        assert gone(place.b / "open.txt")
        assert os.pread(f.fileno(), 100, 0) == b"Hello"
        st = os.fstat(f.fileno())
        assert st.st_size == 5 and st.st_nlink == 0, st
        os.pwrite(f.fileno(), b", world", 5)
        assert os.pread(f.fileno(), 100, 0) == b"Hello, world"
    assert not (place.a / "open.txt").exists()
    place.flush()
    assert "open.txt" not in place.s3_keys()
    assert not place.errors()


def test_flush_of_one_path_flushes_that_path(mode: Mode) -> None:
    """`objcache flush MNT/mine` uploads the file named "mine" and nothing else (the name
    is not a keyword)."""
    other = f"other-{uuid.uuid4().hex[:8]}"
    (mode.a.mnt / "mine").write_bytes(b"mine")
    (mode.a.mnt / other).write_bytes(b"not yet")
    objcache("flush", str(mode.a.mnt / "mine"))
    keys = {o["Key"] for o in mode.s3.list_objects_v2(Bucket=mode.bucket).get("Contents", [])}
    assert "mine" in keys and other not in keys


def test_concurrent_writers_and_readers(place: Place) -> None:
    payloads = {f"p{i}": os.urandom(256 * 1024) for i in range(16)}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            writer = place.a if int(name[1:]) % 2 else place.b
            (writer / name).write_bytes(payloads[name])
            assert (place.a / name).read_bytes() == payloads[name]
            assert (place.b / name).read_bytes() == payloads[name]
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=work, args=(n,)) for n in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    place.flush()
    for k, v in payloads.items():
        assert hashlib.sha256(place.body(k)).digest() == hashlib.sha256(v).digest()
    assert not place.errors()


def test_cp_and_checksum_tools_work(place: Place, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(7 * MiB))
    subprocess.run(["cp", str(src), str(place.a / "copy.bin")], check=True)

    def sha(p: Path) -> str:
        return subprocess.run(["sha256sum", str(p)], capture_output=True, text=True,
                              check=True).stdout.split()[0]
    assert sha(src) == sha(place.a / "copy.bin") == sha(place.b / "copy.bin")


def test_mmap_reads(place: Place) -> None:
    data = os.urandom(3 * MiB)
    place.put("m.bin", data)
    with open(place.b / "m.bin", "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[MiB:MiB + 4096] == data[MiB:MiB + 4096]
        assert mm[:] == data


def test_read_only_handle_keeps_its_version_within_a_node(place: Place) -> None:
    """A handle opened before another handle on the same node rewrites the file reads
    the new bytes (one page cache per node); a new open on another node sees them too."""
    (place.a / "v").write_bytes(b"first")
    with open(place.a / "v", "rb") as r:
        assert r.read() == b"first"
        (place.a / "v").write_bytes(b"second!")
        assert (place.b / "v").read_bytes() == b"second!"


def test_mkdir_rmdir_and_errors(place: Place) -> None:
    a, b = place.a, place.b
    (a / "d").mkdir(mode=0o750)
    assert seen(lambda: stat.S_IMODE(os.stat(b / "d").st_mode) == 0o750)
    with pytest.raises(FileExistsError):
        (b / "d").mkdir()
    (b / "d" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as e:
        os.rmdir(a / "d")
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.rmdir(a / "d" / "f")
    with pytest.raises(IsADirectoryError):
        os.unlink(a / "d")
    os.unlink(b / "d" / "f")
    os.rmdir(a / "d")
    assert gone(b / "d")
    with pytest.raises(OSError) as e:
        os.mkdir(a / ("n" * 1100))
    assert e.value.errno == errno.ENAMETOOLONG
    # statfs's f_namemax is 255: a 256-byte name is refused by every call
    assert os.statvfs(a).f_namemax == 255
    (a / ("d" * 255)).mkdir()
    long = "n" * 256
    for call in (lambda: os.mkdir(a / long), lambda: (a / long).write_bytes(b"x"),
                 lambda: os.symlink("t", a / long), lambda: os.stat(a / long),
                 lambda: os.rename(a / ("d" * 255), a / long)):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.ENAMETOOLONG
    # a directory links its subdirectories; truncating past S3's largest object is EFBIG
    (a / "top" / "sub").mkdir(parents=True)
    (a / "top" / "f").write_bytes(b"x")
    assert sorted(os.listdir(a / "top")) == ["f", "sub"]
    assert os.stat(a / "top").st_nlink == 3
    with pytest.raises(OSError) as e:
        os.truncate(a / "top" / "f", 10**15)
    assert e.value.errno == errno.EFBIG
    assert os.stat(a / "top" / "f").st_size == 1
    assert not place.errors()


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100


def renameat2(old: Path, new: Path, flags: int) -> None:
    fn = _libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    if fn(AT_FDCWD, bytes(old), AT_FDCWD, bytes(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    fn = _libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if fn(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_special_files(place: Place) -> None:
    """mkfifo/mknod make an empty object whose mode has the file type (s3fs-fuse's
    convention); the kernel runs the pipe itself."""
    a, b = place.a, place.b
    os.mkfifo(a / "fifo", 0o640)
    os.mknod(a / "sock", stat.S_IFSOCK | 0o600)
    os.mknod(a / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.mknod(a / "plain", stat.S_IFREG | 0o600)
    for root in (a, b):
        st = seen(lambda root=root: os.lstat(root / "fifo"))
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
        assert stat.S_ISSOCK(os.lstat(root / "sock").st_mode)
        st = os.lstat(root / "chr")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), st
        assert stat.S_ISREG(os.lstat(root / "plain").st_mode)
        with pytest.raises(PermissionError):  # the mount is nodev: never the real device
            open(root / "chr", "rb").close()
    # A FIFO on the mount is a pipe between two processes of one node.
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((a / "fifo").read_bytes()))
    reader.start()
    with open(a / "fifo", "wb") as w:
        w.write(b"progress 42%\n")
    reader.join(10)
    assert got == [b"progress 42%\n"]
    # chmod, rename and unlink work on it like on any file.
    os.chmod(a / "fifo", 0o600)
    os.rename(a / "fifo", a / "fifo2")
    st = seen(lambda: os.lstat(b / "fifo2"))
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert gone(b / "fifo")
    os.unlink(b / "sock")
    assert gone(a / "sock")
    with pytest.raises(FileExistsError):
        os.mkfifo(b / "fifo2")
    place.flush()
    assert place.body("fifo2") == b""
    assert stat.S_ISFIFO(int(place.head("fifo2")["Metadata"]["mode"]))
    meta = place.head("chr")["Metadata"]
    assert stat.S_ISCHR(int(meta["mode"])) and int(meta["rdev"]) == os.makedev(1, 3)
    assert "sock" not in place.s3_keys()
    assert not place.errors()


def test_ctime_and_atime(place: Place) -> None:
    """utimensat sets atime and mtime; chmod, chown, rename, truncate and writes move ctime;
    reads do not move atime (noatime). All of it reaches S3 as s3fs-fuse stores it."""
    a, b = place.a, place.b
    (a / "f").write_bytes(b"data")
    os.utime(a / "f", ns=(1_500_000_000_123_456_789, 1_600_000_000_987_654_321))
    st = seen(lambda: (s := os.stat(b / "f")).st_atime_ns == 1_500_000_000_123_456_789
              and s)
    assert st.st_mtime_ns == 1_600_000_000_987_654_321, st
    set_at = st.st_ctime_ns
    assert set_at > time.time_ns() - 60 * 10**9  # utimensat moved ctime to now
    time.sleep(0.05)
    (b / "f").read_bytes()
    assert os.stat(a / "f").st_atime_ns == 1_500_000_000_123_456_789  # noatime
    for change in (lambda: os.chmod(a / "f", 0o600),
                   lambda: os.chown(a / "f", os.getuid(), os.getgid()),
                   lambda: os.rename(a / "f", a / "g"),
                   lambda: os.rename(a / "g", a / "f")):
        before = os.stat(a / "f").st_ctime_ns if (a / "f").exists() else 0
        time.sleep(0.02)
        change()
        path = a / "f" if (a / "f").exists() else a / "g"
        st = os.stat(path)
        assert st.st_ctime_ns > before, (change, st)
        assert st.st_mtime_ns == 1_600_000_000_987_654_321, st  # only ctime moved
    st = seen(lambda: (s := os.stat(b / "f")).st_ctime_ns > set_at and s)
    assert st.st_ctime_ns > set_at and st.st_mtime_ns == 1_600_000_000_987_654_321
    place.flush()
    meta = place.head("f")["Metadata"]
    assert meta["atime"] == "1500000000.123456789"
    assert meta["mtime"] == "1600000000.987654321"
    assert int(meta["ctime"].partition(".")[0]) >= set_at // 10**9
    # clean (in S3): a chmod rewrites the object's metadata with the new ctime
    time.sleep(1.1)
    os.chmod(a / "f", 0o640)
    place.flush()
    after = place.head("f")["Metadata"]
    assert int(after["ctime"].partition(".")[0]) > int(meta["ctime"].partition(".")[0])
    assert after["atime"] == meta["atime"] and after["mtime"] == meta["mtime"]
    assert not place.errors()


def test_rename_flags(place: Place) -> None:
    a = place.a
    (a / "x").write_bytes(b"x")
    (a / "y").write_bytes(b"y")
    with pytest.raises(FileExistsError):
        renameat2(a / "x", a / "y", 1)  # RENAME_NOREPLACE
    renameat2(a / "x", a / "z", 1)
    assert (place.b / "z").read_bytes() == b"x"
    with pytest.raises(OSError) as e:
        renameat2(a / "z", a / "y", 2)  # RENAME_EXCHANGE: not supported (documented)
    assert e.value.errno == errno.EINVAL
    assert (a / "z").read_bytes() == b"x" and (a / "y").read_bytes() == b"y"


def test_shared_writable_mmap(place: Place) -> None:
    data = bytearray(os.urandom(2 * MiB))
    (place.a / "m").write_bytes(bytes(data))
    with open(place.a / "m", "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[100:105] = b"HELLO"
        mm[MiB + 7:MiB + 12] = b"WORLD"
        mm.flush()
    data[100:105] = b"HELLO"
    data[MiB + 7:MiB + 12] = b"WORLD"
    assert seen(lambda: (place.b / "m").read_bytes() == data)
    place.flush()
    assert place.body("m") == data
    assert not place.errors()


def test_o_append_from_two_handles(place: Place) -> None:
    (place.a / "log").write_bytes(b"")
    with open(place.a / "log", "ab") as f1, open(place.a / "log", "ab") as f2:
        for i in range(20):
            (f1 if i % 2 else f2).write(b"line %02d\n" % i)
            f1.flush()
            f2.flush()
    want = b"".join(b"line %02d\n" % i for i in range(20))
    assert (place.a / "log").read_bytes() == want
    assert seen(lambda: (place.b / "log").read_bytes() == want)


def test_fallocate(place: Place) -> None:
    """fallocate(2) is not implemented (the kernel gives EOPNOTSUPP); posix_fallocate
    falls back to writing zeros and works."""
    with open(place.a / "pre", "w+b") as f:
        with pytest.raises(OSError) as e:
            fallocate(f.fileno(), 0, 0, MiB)
        assert e.value.errno == errno.EOPNOTSUPP
        os.posix_fallocate(f.fileno(), 0, MiB)
        assert os.fstat(f.fileno()).st_size == MiB
    assert (place.b / "pre").read_bytes() == bytes(MiB)
