"""The filesystem core's POSIX behaviour, one test body for both backends: a single node
(LocalBackend) and a cluster of two in-process members forming a real Raft group
(ReplicatedBackend), both over an in-memory store. Built by the daemon's own assembly
(objcache.daemon.build), driven without FUSE through tests/helpers/inproc.Posix.

In the cluster, `env.b` is the other member: what one node changes, the other must show
(after its own open or lookup; the kernel's caches are not in play here). The real-mount
versions of these cases are tests/integration/test_posix.py."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest
import trio

from objcache.core.filesystem import RENAME_EXCHANGE, RENAME_NOREPLACE
from objcache.errors import ObjcacheError
from tests.conformance.conftest import Env
from tests.helpers.inproc import MiB, Posix, config, node, now
from tests.helpers.memstore import MemoryStore


def errno_of(exc: pytest.ExceptionInfo[ObjcacheError]) -> int:
    return exc.value.errno


async def test_create_write_read_and_attributes(env: Env) -> None:
    data = os.urandom(3 * MiB + 17)
    await env.a.write("f.bin", data, mode=0o640)
    for p in (env.a, env.b):
        assert await p.read("f.bin") == data
        a = await p.stat("f.bin")
        assert a.size == len(data) and stat.S_IMODE(a.mode) == 0o640
        assert stat.S_ISREG(a.mode) and a.uid == os.getuid() and a.nlink == 1
    assert await env.flush() >= 1
    assert env.objects["f.bin"][0] == data
    assert int(env.objects["f.bin"][1]["mode"]) == stat.S_IFREG | 0o640


async def test_s3_objects_and_metadata_are_shown(env: Env) -> None:
    env.put("d/x", b"xx", {"mode": str(stat.S_IFREG | 0o600), "uid": "7",
                                 "gid": "8", "mtime": "1600000000"})
    env.put("d/link", b"x", {"mode": str(stat.S_IFLNK | 0o777)})
    env.put("d/sub/y", b"y")
    for p in (env.a, env.b):
        assert sorted(await p.listdir("d")) == ["link", "sub", "x"]
        a = await p.stat("d/x")
        assert (stat.S_IMODE(a.mode), a.uid, a.gid, a.mtime_ns) == (0o600, 7, 8,
                                                                     1600000000 * 10**9)
        assert await p.readlink("d/link") == "x"
        assert stat.S_ISDIR((await p.stat("d/sub")).mode)
        assert await p.read("d/sub/y") == b"y"


async def test_mkdir_rmdir_and_their_errors(env: Env) -> None:
    a, b = env.a, env.b
    await a.mkdir("d", 0o750)
    await env.settle()
    assert stat.S_IMODE((await b.stat("d")).mode) == 0o750
    with pytest.raises(ObjcacheError) as e:
        await b.mkdir("d")
    assert errno_of(e) == errno.EEXIST
    await b.write("d/f", b"x")
    with pytest.raises(ObjcacheError) as e:
        await a.rmdir("d")
    assert errno_of(e) == errno.ENOTEMPTY
    with pytest.raises(ObjcacheError) as e:
        await a.rmdir("d/f")
    assert errno_of(e) == errno.ENOTDIR
    with pytest.raises(ObjcacheError) as e:
        await a.unlink("d")
    assert errno_of(e) == errno.EISDIR
    with pytest.raises(ObjcacheError) as e:
        await a.mkdir("d/f/x")
    assert errno_of(e) == errno.ENOTDIR
    await b.unlink("d/f")
    await a.rmdir("d")
    await env.settle()
    for p in (a, b):
        assert not await p.exists("d")
    with pytest.raises(ObjcacheError) as e:
        await a.rmdir("d")
    assert errno_of(e) == errno.ENOENT
    await env.flush()
    assert "d/" not in env.objects


async def test_a_directory_links_count_its_subdirectories(env: Env) -> None:
    for d in ("top", "top/a", "top/b", "top/b/deep"):
        await env.a.mkdir(d)
    await env.a.write("top/f", b"x")
    await env.settle()
    for p in (env.a, env.b):
        assert sorted(await p.listdir("top")) == ["a", "b", "f"]
        assert (await p.stat("top")).nlink == 4
        assert (await p.stat("top/a")).nlink == 2
    await env.a.rmdir("top/a")
    await env.settle()
    for p in (env.a, env.b):
        await p.listdir("top")
        assert (await p.stat("top")).nlink == 3


async def test_names(env: Env) -> None:
    for bad in ("a/b", "", ".", ".."):
        with pytest.raises(ObjcacheError) as e:
            await env.a.fs.mkdir(1, bad, 0o755, 0, 0)
        assert errno_of(e) == errno.EINVAL
    with pytest.raises(ObjcacheError) as e:
        await env.a.fs.lookup(1, b"\xff\xfe")
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(ObjcacheError) as e:
        await env.a.mkdir("n" * 1100)
    assert errno_of(e) == errno.ENAMETOOLONG
    # statfs says f_namemax = 255: one byte more is ENAMETOOLONG everywhere, lookups too
    await env.a.mkdir("d" * 255)
    await env.a.write("é" * 127 + "x", b"255 bytes")  # 2 bytes per é
    long = "n" * 256
    for call in (lambda: env.a.mkdir(long), lambda: env.a.write(long, b"x"),
                 lambda: env.a.symlink(long, "target"), lambda: env.a.stat(long),
                 lambda: env.a.rename("d" * 255, long), lambda: env.a.write("é" * 128, b"")):
        with pytest.raises(ObjcacheError) as e:
            await call()
        assert errno_of(e) == errno.ENAMETOOLONG
    await env.a.write("ünï cødé + space", b"u")
    assert await env.b.read("ünï cødé + space") == b"u"


async def test_rename_files_and_directories(env: Env) -> None:
    a, b = env.a, env.b
    env.put("clean", b"clean")
    for i in range(3):
        env.put(f"tree/sub/f{i}", str(i).encode())
    await a.write("dirty", b"dirty")
    await a.rename("clean", "moved")
    await a.rename("dirty", "tree/sub/dirty")
    await a.mkdir("other")
    await a.rename("tree", "other/tree2")
    await env.settle()
    for p in (a, b):
        assert not await p.exists("clean") and not await p.exists("tree")
        assert await p.read("moved") == b"clean"
        assert sorted(await p.listdir("other/tree2/sub")) == ["dirty", "f0", "f1", "f2"]
        assert await p.read("other/tree2/sub/dirty") == b"dirty"
        assert await p.read("other/tree2/sub/f1") == b"1"
    await env.flush()
    keys = set(env.objects)
    assert {"moved", "other/tree2/sub/dirty", "other/tree2/sub/f0"} <= keys
    assert not {k for k in keys if k.startswith("tree/") or k in ("clean", "dirty")}


async def test_rename_rules(env: Env) -> None:
    a, b = env.a, env.b
    await a.write("f", b"f")
    await a.write("g", b"g")
    await a.mkdir("d")
    await a.mkdir("e")
    await a.write("e/x", b"x")
    cases = [("f", "g", RENAME_NOREPLACE, errno.EEXIST),
             ("f", "g", RENAME_EXCHANGE, errno.EINVAL),
             ("f", "d", 0, errno.EISDIR),
             ("d", "f", 0, errno.ENOTDIR),
             ("d", "e", 0, errno.ENOTEMPTY),
             ("d", "d/inside", 0, errno.EINVAL),
             ("missing", "z", 0, errno.ENOENT)]
    for old, new, flags, code in cases:
        with pytest.raises(ObjcacheError) as e:
            await a.rename(old, new, flags)
        assert errno_of(e) == code, (old, new, flags)
    await a.rename("f", "f")  # to itself: nothing happens
    await a.rename("f", "g")  # replaces a file
    await env.settle()
    assert await b.read("g") == b"f" and not await b.exists("f")
    await a.unlink("e/x")
    await a.rename("d", "e")  # replaces an empty directory
    await env.settle()
    assert stat.S_ISDIR((await b.stat("e")).mode) and not await b.exists("d")


async def test_symlinks(env: Env) -> None:
    await env.a.write("target", b"t")
    await env.a.symlink("ln", "target")
    await env.settle()
    a = await env.b.stat("ln")
    assert stat.S_ISLNK(a.mode) and a.size == len("target")
    assert await env.b.readlink("ln") == "target"
    with pytest.raises(ObjcacheError) as e:
        await env.a.readlink("target")
    assert errno_of(e) == errno.EINVAL
    with pytest.raises(ObjcacheError) as e:
        await env.b.symlink("ln", "elsewhere")
    assert errno_of(e) == errno.EEXIST
    await env.flush()
    assert env.objects["ln"][0] == b"target"


async def test_truncate_sizes_zeros_and_times(env: Env) -> None:
    """truncate() and ftruncate() change the size, read back zeros past the old end, and
    move mtime (the cluster used to keep the old mtime)."""
    base = os.urandom(3 * MiB)
    env.put("t.bin", base)
    old = 1_000_000_000
    await env.a.utime("t.bin", old)
    t0 = now()
    await env.a.truncate("t.bin", MiB + 5)
    await env.a.truncate("t.bin", 2 * MiB)
    await env.settle()
    for p in (env.a, env.b):
        a = await p.stat("t.bin")
        assert a.size == 2 * MiB and a.mtime_ns >= int(t0 * 1e9) - 10**9, (p, a)
        assert await p.read("t.bin") == base[:MiB + 5] + bytes(MiB - 5)
    await env.a.utime("t.bin", old)
    fh = await env.a.open("t.bin", os.O_RDWR)
    await env.a.fs.setattr(await env.a.ino("t.bin"), size=10, fh=fh)
    await env.a.close(fh)
    await env.settle()
    for p in (env.a, env.b):
        a = await p.stat("t.bin")
        assert a.size == 10 and a.mtime_ns > old * 10**9
        assert await p.read("t.bin") == base[:10]
    await env.a.mkdir("dir")
    with pytest.raises(ObjcacheError) as e:
        await env.a.truncate("dir", 0)
    assert errno_of(e) == errno.EISDIR
    # beyond the largest object S3 takes (5 TiB): EFBIG, not ENOSPC; nothing changes
    for size in (10**15, (5 << 40) + 1):
        with pytest.raises(ObjcacheError) as e:
            await env.a.truncate("t.bin", size)
        assert errno_of(e) == errno.EFBIG
    fh = await env.a.open("t.bin", os.O_RDWR)
    with pytest.raises(ObjcacheError) as e:
        await env.a.fs.write(fh, 5 << 40, b"x")
    assert errno_of(e) == errno.EFBIG
    await env.a.close(fh)
    assert (await env.a.stat("t.bin")).size == 10


async def test_o_trunc_without_a_write_empties_the_file(env: Env) -> None:
    """open(O_TRUNC) and close() with nothing written: empty everywhere, mtime moved."""
    await env.a.write("f", b"old bytes")
    await env.a.utime("f", 1_000_000_000)
    fh = await env.b.open("f", os.O_WRONLY | os.O_TRUNC)
    await env.b.close(fh)
    await env.a.fs.sync()
    for p in (env.a, env.b):
        a = await p.stat("f")
        assert a.size == 0 and a.mtime_ns > 1_000_000_000 * 10**9, a
        assert await p.read("f") == b""
    await env.flush()
    assert env.objects["f"][0] == b""


async def test_unlink_of_an_open_dirty_file_keeps_its_data(env: Env) -> None:
    """The open descriptor keeps the data until the last close; nothing reaches S3."""
    fh = await env.a.create("open.txt")
    await env.a.fs.write(fh, 0, b"Hello")
    await env.a.fs.flush(fh)
    ino = await env.a.ino("open.txt")
    await env.a.unlink("open.txt")
    await env.settle()
    for p in (env.a, env.b):
        assert not await p.exists("open.txt")
    assert await env.a.fs.read(fh, 0, 100) == b"Hello"
    a = await env.a.fs.getattr(ino)
    assert a.size == 5 and a.nlink == 0
    await env.a.fs.write(fh, 5, b", world")
    assert await env.a.fs.read(fh, 0, 100) == b"Hello, world"
    assert (await env.a.fs.getattr(ino)).size == 12
    await env.a.close(fh)
    await env.flush()
    assert "open.txt" not in env.objects


async def test_attributes_change_and_reach_s3(env: Env) -> None:
    env.put("clean", b"c")
    await env.a.write("dirty", b"d")
    for path in ("clean", "dirty"):
        await env.a.chmod(path, 0o600)
        await env.a.chown(path, 1234, 4321)
        await env.a.utime(path, 1_500_000_000)
        await env.settle()
        for p in (env.a, env.b):
            a = await p.stat(path)
            assert (stat.S_IMODE(a.mode), a.uid, a.gid, a.mtime_ns) == \
                (0o600, 1234, 4321, 1_500_000_000 * 10**9), (path, a)
    await env.a.mkdir("d")
    await env.a.chmod("d", 0o700)
    await env.settle()
    assert stat.S_IMODE((await env.b.stat("d")).mode) == 0o700
    await env.flush()
    for path in ("clean", "dirty"):
        meta = env.objects[path][1]
        assert (int(meta["mode"]) & 0o777, meta["uid"], meta["gid"], meta["mtime"]) == \
            (0o600, "1234", "4321", "1500000000")
    assert int(env.objects["d/"][1]["mode"]) & 0o777 == 0o700
    assert env.objects["clean"][0] == b"c"


async def test_partial_write_to_a_large_object(env: Env) -> None:
    base = bytearray(os.urandom(5 * MiB))
    env.put("big", bytes(base))
    fh = await env.a.open("big", os.O_RDWR)
    await env.a.fs.write(fh, 3 * MiB + 3, b"PATCH")
    await env.a.close(fh)
    base[3 * MiB + 3:3 * MiB + 8] = b"PATCH"
    assert await env.b.read("big") == bytes(base)
    await env.flush()
    assert env.objects["big"][0] == bytes(base)


async def test_fsync_makes_the_file_durable(env: Env) -> None:
    fh = await env.a.create("s")
    await env.a.fs.write(fh, 0, b"synced")
    await env.a.fs.fsync(fh)
    if env.kind == "local":
        assert env.objects["s"][0] == b"synced"  # one node: durable = in S3
    else:
        assert await env.b.read("s") == b"synced"  # a cluster: replicated and committed
    await env.a.fs.release(fh)


async def test_flush_of_one_path_flushes_that_path(env: Env) -> None:
    """A flush names its target by key; no file name is a keyword ("mine", "all")."""
    for name in ("mine", "all", "other"):
        await env.a.write(name, name.encode())
    assert await env.flush("mine") == 1
    assert "mine" in env.objects and "all" not in env.objects
    await env.flush("all")
    assert "all" in env.objects and "other" not in env.objects
    await env.a.mkdir("sub")
    await env.a.write("sub/x", b"x")
    await env.a.write("subway", b"w")
    await env.flush("sub")
    assert "sub/x" in env.objects and "subway" not in env.objects


async def test_close_to_open_across_nodes(env: Env) -> None:
    """After close() returns on A, an open on B shows the new size and bytes (no wait)."""
    await env.a.write("c2o", b"v1")
    assert await env.b.read("c2o") == b"v1"
    ino = await env.b.ino("c2o")
    for i in range(5):
        data = os.urandom(1000 + i * 100_000)
        await env.a.write("c2o", data)
        fh = await env.b.open("c2o")
        assert (await env.b.fs.getattr(ino)).size == len(data)
        assert await env.b.pread(fh, 0, 1 << 30) == data
        await env.b.fs.release(fh)


async def test_close_to_open_while_this_nodes_last_writer_is_not_released(env: Env) -> None:
    """The kernel sends RELEASE after close(2) has returned: a node whose writer closed
    (committed) but is not released yet still opens, after another node's close, what
    that node committed, not its own older working copy (found by the partition
    nemesis on a healthy cluster)."""
    await env.b.write("f", b"b-first")
    fh = await env.b.open("f", os.O_WRONLY | os.O_TRUNC)
    await env.b.fs.write(fh, 0, b"b-second")
    await env.b.fs.flush(fh)  # close(2) returned; the RELEASE has not come yet
    await env.a.write("f", b"a-third")
    assert await env.b.read("f") == b"a-third"
    # A new working copy of the name while the old one is set aside: they must not share
    # a data file (a reused file id did, and the old one's removal deleted the new one's).
    fh2 = await env.b.open("f", os.O_WRONLY | os.O_TRUNC)
    await env.b.fs.write(fh2, 0, b"b-fourth")
    await env.b.fs.flush(fh2)
    await env.b.fs.release(fh)
    await env.b.fs.write(fh2, 8, b"!")
    await env.b.close(fh2)
    assert await env.b.read("f") == b"b-fourth!"
    assert await env.a.read("f") == b"b-fourth!"


async def test_a_changed_object_is_seen_after_the_ttl(env: Env, tmp_path: Path) -> None:
    env.put("v", b"one")
    ttl = env.a.fs.ttl
    assert await env.a.read("v") == b"one"
    env.put("v", b"two, longer")
    env.a.fs.ttl = 0.2  # (the mount flag --metadata-ttl)
    try:
        await trio.sleep(0.3)
        assert await env.a.read("v") == b"two, longer"
        del env.objects["v"]
        await trio.sleep(0.3)
        assert not await env.a.exists("v")
    finally:
        env.a.fs.ttl = ttl


async def test_read_only_mount_refuses_changes(tmp_path: Path) -> None:
    store = MemoryStore()
    store.put("f", b"f")
    async with node(config(read_only=True), store, tmp_path / "ro") as p:
        fs = Posix(p.fs)
        assert await fs.read("f") == b"f"
        for call in (fs.mkdir("d"), fs.unlink("f"), fs.truncate("f", 0), fs.write("g", b"")):
            with pytest.raises(ObjcacheError) as e:
                await call
            assert errno_of(e) == errno.EROFS


async def test_statfs(env: Env) -> None:
    s = env.a.fs.statfs()
    assert s["namemax"] == 255 and s["blocks"] >= s["bfree"] > 0


async def test_a_directory_stays_the_same_directory_when_its_marker_is_written_back(
        env: Env) -> None:
    """Write-back of a new directory's marker changes nothing a reader can see: the
    directory another node has open keeps its inode, and lists."""
    await env.a.mkdir("d")
    await env.settle()
    ino = await env.b.ino("d")
    assert await env.b.fs.readdir(ino) == []
    await env.flush()  # (one node: mkdir made it at once)
    assert "d/" in env.objects
    await env.settle()
    await trio.sleep(0.05)  # the change reaches B's core
    assert await env.b.ino("d") == ino
    assert await env.b.fs.readdir(ino) == []


async def test_the_last_release_while_the_next_o_trunc_open_copies_the_blob(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer loop (open O_TRUNC, write, close) on a cluster node: the kernel's RELEASE
    of the previous handle may arrive while the next open(O_TRUNC) copies the sealed blob
    out of the working copy. That release dropped the working copy, nobody having it
    open yet, and deleted its data file: the open answered EIO (FileNotFoundError; the
    partition nemesis, on healthy nodes)."""
    from objcache.cache import localfiles
    from tests.helpers.inproc import FaultyStore, cluster

    async with cluster(FaultyStore(MemoryStore()), tmp_path, 2) as (p0, p1):
        a, b = Posix(p0.fs), Posix(p1.fs)
        fh1 = await b.create("f")
        await b.fs.write(fh1, 0, b"first")
        await b.fs.flush(fh1)  # close(2) returned: sealed, committed; no RELEASE yet
        copy, copies = localfiles._copy_file, []

        def release_then_copy(src: str, dst: str) -> None:
            copies.append(src)
            trio.from_thread.run(b.fs.release, fh1)
            copy(src, dst)

        monkeypatch.setattr(localfiles, "_copy_file", release_then_copy)
        fh2 = await b.open("f", os.O_WRONLY | os.O_TRUNC)
        assert copies, "the open did not copy the sealed blob: the race was not run"
        await b.fs.write(fh2, 0, b"second")
        await b.close(fh2)
        assert await a.read("f") == b"second"
        assert await b.read("f") == b"second"


async def test_the_release_after_the_next_o_trunc_open_does_not_commit_its_truncation(
        tmp_path: Path) -> None:
    """The kernel sends the RELEASE of a closed handle after close(2) returned, and the
    next open(O_TRUNC) of the file may come first. That RELEASE found the working copy
    dirty (truncated by the open) and committed it: every node read an empty file
    before the writer wrote or closed, and for good when its close then failed (the
    partition nemesis, 5 nodes: an acknowledged register ended empty everywhere)."""
    from tests.helpers.inproc import FaultyStore, cluster

    async with cluster(FaultyStore(MemoryStore()), tmp_path, 2) as (p0, p1):
        a, b = Posix(p0.fs), Posix(p1.fs)
        fh1 = await b.create("f")
        await b.fs.write(fh1, 0, b"first")
        await b.fs.flush(fh1)  # close(2) returned; its RELEASE is still on its way
        fh2 = await b.open("f", os.O_WRONLY | os.O_TRUNC)
        await b.fs.release(fh1)
        assert await a.read("f") == b"first", "the RELEASE committed the next truncation"
        await b.fs.write(fh2, 0, b"second")
        await b.close(fh2)
        assert await a.read("f") == b"second"
        assert await b.read("f") == b"second"


class _HeldToken:
    """A node's Raft member hands what it applied to the trio thread through its trio
    token; while `holding`, those callbacks are kept, to be run later in one batch."""

    def __init__(self, real: trio.lowlevel.TrioToken) -> None:
        self.real = real
        self.holding = True
        self.held: list[tuple[object, tuple[object, ...]]] = []

    def run_sync_soon(self, fn: object, *args: object) -> None:
        if self.holding:
            self.held.append((fn, args))  # (list.append: safe from pysyncobj's thread)
        else:
            self.real.run_sync_soon(fn, *args)  # type: ignore[arg-type]


async def test_changes_another_node_applied_in_one_batch_are_shown_in_log_order(
        tmp_path: Path) -> None:
    """A node cut off from the majority catches up with the log in one burst when it
    rejoins. The first change of the burst went straight to the core's task waiting for
    changes, the rest waited in the channel, and a call that caught up before that task
    ran (a barrier that had just failed: "serving from what this node has applied")
    applied the rest first: the unlink of a renamed file found no such name, then the
    rename put the name into the listing, for good (the partition nemesis, 5 nodes, seed
    2116: `ns/n4w0-464.r` listed on one node after its unlink was acknowledged)."""
    from tests.helpers.inproc import FaultyStore, cluster

    async with cluster(FaultyStore(MemoryStore()), tmp_path, 2) as (p0, p1):
        a, b = Posix(p0.fs), Posix(p1.fs)
        await a.mkdir("d")
        await a.write("d/f", b"x" * 100)
        assert await b.listdir("d") == ["f"]  # b has the directory listed
        assert p1.member is not None
        group = p1.member.node.raft
        token = _HeldToken(group._token)  # type: ignore[arg-type]
        group._token = token  # type: ignore[assignment]
        await a.rename("d/f", "d/f.r")
        await a.unlink("d/f.r")
        with trio.fail_after(10):
            while len(token.held) < 2:  # b's member applied both (b cut off from them)
                await trio.sleep(0.01)
        token.holding = False
        # b's barrier just failed: it serves what it has applied, without a round.
        p1.backend.txn._degraded_until = time.monotonic() + 60  # type: ignore[attr-defined]
        for fn, args in token.held:  # one batch, as trio's run_sync_soon queue runs them
            fn(*args)  # type: ignore[operator]
        await b.fs.sync()  # (no checkpoint before it takes the changes)
        await trio.sleep(0.1)  # the core's own task takes what it was handed
        assert await b.listdir("d") == []
        assert not await b.exists("d/f.r")


async def test_an_o_trunc_open_that_fails_after_its_truncate_leaves_the_file_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open(O_TRUNC) can fail after it truncated the working copy (the kernel's
    backing file of the inode changed meanwhile: ESTALE). Nobody was going to close that
    copy, and it stayed what the node showed: the next read there returned an empty file
    that nobody wrote (the partition nemesis, 5 nodes)."""
    from objcache.core.filesystem import Filesystem
    from objcache.core.handles import FileHandle
    from objcache.errors import StaleObject
    from tests.helpers.inproc import FaultyStore, cluster

    async with cluster(FaultyStore(MemoryStore()), tmp_path, 2) as (p0, p1):
        a, b = Posix(p0.fs), Posix(p1.fs)
        await b.write("f", b"first")
        pass_through = Filesystem._pass_through

        def stale(self: Filesystem, h: FileHandle) -> int:
            raise StaleObject("the backing file changed")

        monkeypatch.setattr(Filesystem, "_pass_through", stale)
        with pytest.raises(StaleObject):
            await b.open("f", os.O_WRONLY | os.O_TRUNC)
        monkeypatch.setattr(Filesystem, "_pass_through", pass_through)
        assert await b.read("f") == b"first"
        assert await a.read("f") == b"first"
