"""Namespace and dirty state through Raft transactions, across daemons as separate
processes: one listing everywhere, close-to-open between nodes, atomic directory renames,
a leader killed mid-storm, nodes lost in turn with their cache dirs, drain to zero."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.mount import Mount, objcache

MiB = 1 << 20
WB = ("--writeback-delay", "3600")  # nothing uploads unless a test asks


def _tree(root: Path) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        out += [os.path.normpath(os.path.join(rel, n)) + "/" for n in dirs]
        out += [os.path.normpath(os.path.join(rel, n)) for n in files]
    return sorted(out)


def _wait(cond, timeout: float = 20.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _three(cluster, *extra: str) -> list[Mount]:  # type: ignore[no-untyped-def]
    nodes = [cluster.add(*WB, *extra) for _ in range(3)]
    cluster.wait_raft(nodes, 3)
    return nodes


def _objects(s3, bucket: str) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_creates_from_all_nodes_converge_and_close_to_open(cluster, s3, bucket):  # type: ignore
    nodes = _three(cluster)
    errors: list[BaseException] = []

    def writer(i: int, m: Mount) -> None:
        try:
            os.makedirs(m.mnt / "shared", exist_ok=True)
            for j in range(40):
                (m.mnt / "shared" / f"n{i}-{j}").write_bytes(f"{i}:{j}".encode())
                try:  # every node also races on the same names: exactly one wins each
                    fd = os.open(m.mnt / "shared" / f"race-{j}",
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.write(fd, str(i).encode())
                    os.close(fd)
                except FileExistsError:
                    pass
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i, m)) for i, m in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    listings = [_tree(m.mnt) for m in nodes]
    assert listings[0] == listings[1] == listings[2]
    assert len([n for n in listings[0] if n.startswith("shared/n")]) == 120
    assert len([n for n in listings[0] if n.startswith("shared/race-")]) == 40
    # Each race has one winner, and every node reads the winner's content.
    for j in range(40):
        got = {(m.mnt / "shared" / f"race-{j}").read_bytes() for m in nodes}
        assert len(got) == 1 and got.pop() in (b"0", b"1", b"2")

    # Close-to-open: after close() on A returns, B sees the new size and bytes at once.
    a, b = nodes[0], nodes[1]
    (b.mnt / "shared" / "n0-0").read_bytes()  # B has it cached
    for k in range(20):
        data = os.urandom(1000 + k * 50_000)
        with open(a.mnt / "shared" / "n0-0", "wb") as f:
            f.write(data)
        with open(b.mnt / "shared" / "n0-0", "rb") as f:
            assert os.fstat(f.fileno()).st_size == len(data)
            assert f.read() == data
    # Unlink and rename on A reach B's kernel as soon as B applies them (invalidation, not
    # a timeout: the kernel would otherwise keep the names for --metadata-ttl, 30 s).
    os.unlink(a.mnt / "shared" / "n1-1")
    _wait(lambda: not (b.mnt / "shared" / "n1-1").exists(), 2, "unlink seen on B")
    os.rename(a.mnt / "shared" / "n2-2", a.mnt / "shared" / "moved")
    assert (b.mnt / "shared" / "moved").read_bytes() == b"2:2"  # a new name: at once
    _wait(lambda: not (b.mnt / "shared" / "n2-2").exists(), 2, "rename seen on B")
    # Nothing reached S3 yet (write-back delay of an hour): all of it lives in the cluster.
    assert not any(k.startswith("shared/n") for k in _objects(s3, bucket))
    for m in nodes:
        assert m.errors_in_log() == []


def test_directory_rename_is_atomic_everywhere(cluster, s3, bucket):  # type: ignore
    for i in range(30):
        s3.put_object(Bucket=bucket, Key=f"ds/s3file{i}", Body=f"old{i}".encode())
    s3.put_object(Bucket=bucket, Key="ds/deep/x", Body=b"deep")
    nodes = _three(cluster)
    a, b, c = nodes
    (a.mnt / "ds" / "new").write_bytes(b"new")
    assert sorted(os.listdir(c.mnt / "ds"))[:2] == ["deep", "new"]
    os.rename(a.mnt / "ds", a.mnt / "renamed")
    for m in (b, c):
        # Gone as soon as the node applied the rename and told its kernel (~ms).
        _wait(lambda m=m: not (m.mnt / "ds").exists(), 2, "rename seen")
        names = sorted(os.listdir(m.mnt / "renamed"))
        assert len(names) == 32 and "new" in names and "deep" in names
        assert (m.mnt / "renamed" / "s3file7").read_bytes() == b"old7"
        assert (m.mnt / "renamed" / "deep" / "x").read_bytes() == b"deep"
        assert (m.mnt / "renamed" / "new").read_bytes() == b"new"
    # Write-back makes S3 match: copies first, then the old keys go.
    out = objcache("flush", str(a.mnt))
    assert out.returncode == 0, out.stderr
    objs = _objects(s3, bucket)
    assert not any(k.startswith("ds/") for k in objs), sorted(objs)
    assert objs["renamed/s3file7"] == b"old7" and objs["renamed/new"] == b"new"
    assert objs["renamed/deep/x"] == b"deep"


def test_leader_killed_during_rename_storm(cluster):  # type: ignore[no-untyped-def]
    # (every voter dumps its state and drops its log every 100 entries, several times in
    # the storm: the killed leader restarts from what its dump and its journal hold)
    nodes = _three(cluster, "--raft-compact-entries", "100")
    for i, m in enumerate(nodes):
        os.makedirs(m.mnt / f"d{i}")
        for j in range(20):
            (m.mnt / f"d{i}" / f"f{j}").write_bytes(f"{i}-{j}".encode())
    leader_addr = nodes[0].status()["cluster"]["raft"]["leader"]
    leader = next(m for m in nodes if m.status()["cluster"]["raft"]["self"] == leader_addr)
    survivors = [m for m in nodes if m is not leader]
    done: dict[int, int] = {}
    errors: list[BaseException] = []

    def storm(i: int, m: Mount) -> None:
        n = 0
        try:
            for rnd in range(6):
                for j in range(20):
                    src = m.mnt / f"d{i}" / (f"f{j}" if rnd == 0 else f"f{j}.{rnd - 1}")
                    os.rename(src, m.mnt / f"d{i}" / f"f{j}.{rnd}")
                    n += 1
        except BaseException as e:
            errors.append(e)
        done[i] = n

    threads = [threading.Thread(target=storm, args=(nodes.index(m), m)) for m in survivors]
    for t in threads:
        t.start()
    time.sleep(0.5)
    leader.kill9()
    for t in threads:
        t.join(180)
    assert not errors, errors
    # The survivors finished every rename; the dead node restarts from its log and rejoins.
    leader.start()
    cluster.wait_raft(nodes, 3, timeout=60)
    for m in nodes:  # each holds fewer entries than were committed: it compacted
        raft = m.status()["cluster"]["raft"]
        assert raft["log_entries"] < raft["commit_index"] - 50, raft
    listings = [_tree(m.mnt) for m in nodes]
    assert listings[0] == listings[1] == listings[2]
    for m in survivors:
        i = nodes.index(m)
        assert sorted(os.listdir(nodes[0].mnt / f"d{i}")) == sorted(
            f"f{j}.5" for j in range(20))
        assert (nodes[0].mnt / f"d{i}" / "f3.5").read_bytes() == f"{i}-3".encode()
    for m in survivors:
        assert m.errors_in_log() == []


def test_voter_back_without_its_log_cannot_elect_a_stale_node(cluster):  # type: ignore
    """Seed 1101 of the partition nemesis, with SIGSTOP for the cut: a voter whose cache
    dir was wiped comes back at its old Raft address. Its empty log must not vote a node
    that missed committed entries into leadership, or those entries are erased."""
    a, b, c = nodes = _three(cluster)  # a falls behind, b keeps the entries, c is wiped
    (b.mnt / "gone").write_bytes(b"unlinked below")
    stopped: list[Mount] = []

    def freeze(m: Mount) -> None:
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGSTOP)
        stopped.append(m)

    def thaw(m: Mount) -> None:
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGCONT)
        stopped.remove(m)

    want = {f"k{j}": os.urandom(1000 + j) for j in range(6)}
    try:
        freeze(a)
        for name, data in want.items():  # acknowledged: committed by b and c
            (b.mnt / name).write_bytes(data)
        os.unlink(b.mnt / "gone")
        freeze(b)
        c.kill9()
        shutil.rmtree(c.cache)
        thaw(a)
        # c restarts with an empty log while only the stale a is up; the mount waits
        # (bounded by --catch-up-seconds) for a leader that holds the log
        failed: list[BaseException] = []

        def restart() -> None:
            try:
                c.start(timeout=90)
            except BaseException as e:
                failed.append(e)

        seen = c.log_path.stat().st_size
        t = threading.Thread(target=restart)
        t.start()
        _wait(lambda: "started with partners ['" in c.log_path.read_bytes()[seen:].decode(
            errors="replace"), 30, "c's Raft member started in the group")
        time.sleep(4)  # several election timeouts (0.4-1.4 s) for a to try
        thaw(b)
        t.join(120)
        assert not failed, failed
    finally:
        for m in list(stopped):
            thaw(m)
    cluster.wait_raft(nodes, 3, timeout=60)
    for m in nodes:
        assert {k: (m.mnt / k).read_bytes() for k in want} == want, m.mnt
        assert not (m.mnt / "gone").exists(), m.mnt


def _staged(nodes: list[Mount]) -> int:
    """The largest stage file (bytes pulled while a file is being written) on `nodes`."""
    return max((f.stat().st_size for n in nodes for f in (n.cache / "dirty").glob("*.stage")),
               default=0)


def _restart_wiped(m: Mount, nodes: list[Mount]) -> None:
    """kill -9 `m` (if it runs), wipe its cache dir, start it again; returns once it is
    mounted."""
    m.kill9()
    shutil.rmtree(m.cache, ignore_errors=True)
    if "--peers" not in m.extra:  # the first node was started with no one to join
        m.extra = (*m.extra, "--peers", ",".join(
            x.addr for x in nodes if x is not m))  # type: ignore[attr-defined]
    m.start(timeout=90)


def test_nodes_lost_in_turn_with_their_cache_dirs_lose_no_closed_file(cluster, s3, bucket
                                                                       ):  # type: ignore
    nodes = _three(cluster, "--chunk-size", "5M")
    a, b, c = nodes
    want = {}
    for j in range(30):
        data = os.urandom(1000 + j * 30_000)
        (a.mnt / f"f{j}").write_bytes(data)
        want[f"f{j}"] = hashlib.sha256(data).hexdigest()
    # A file written front to back: its replica pulls complete chunks while it is written.
    big = os.urandom(21 * MiB)
    with open(a.mnt / "big", "wb", buffering=0) as f:
        for off in range(0, 17 * MiB, MiB):
            f.write(big[off:off + MiB])
        _wait(lambda: _staged([b, c]) >= 15 * MiB, what="chunks staged while writing")
        f.write(big[17 * MiB:])
    want["big"] = hashlib.sha256(big).hexdigest()
    # One still being written when its node dies: staged on a replica, never acknowledged.
    f = open(a.mnt / "unclosed", "wb", buffering=0)  # noqa: SIM115
    try:
        for _ in range(13):
            f.write(os.urandom(MiB))
        _wait(lambda: _staged([b, c]) >= 10 * MiB, what="the open file's chunks staged")
        a.kill9()
    finally:
        with pytest.raises(OSError):
            f.close()
    shutil.rmtree(a.cache)
    # The survivors still read every closed file, then upload all of it.
    for j in (0, 17, 29):
        assert hashlib.sha256((b.mnt / f"f{j}").read_bytes()).hexdigest() == want[f"f{j}"]
    assert hashlib.sha256((c.mnt / "big").read_bytes()).hexdigest() == want["big"]
    assert (b.mnt / "unclosed").read_bytes() == b""  # created (acknowledged), no content
    # A rolling restart without cache dirs (an emptyDir, a node replaced), the next node
    # going as soon as the previous one is mounted. A node back without its log is
    # mounted once its voter votes again and it holds its copies again: before, the
    # second wipe left a group of three with one voter that held the log, and none
    # could be elected again (the partition nemesis, seeds 1953 and 1971, and a CI run),
    # and the files the two wiped nodes held were lost (ESTALE).
    for m in (a, b):
        _restart_wiped(m, nodes)
        raft = m.status()["cluster"]["raft"]
        assert raft["voter"] and raft.get("voting"), raft
    for m in nodes:
        for j in (0, 1, 2, 17, 29):
            assert hashlib.sha256((m.mnt / f"f{j}").read_bytes()).hexdigest() == want[f"f{j}"]
    out = objcache("flush", str(b.mnt), timeout=300)
    assert out.returncode == 0, out.stderr
    objs = _objects(s3, bucket)
    assert objs.pop("unclosed", b"") == b""
    assert {k: hashlib.sha256(v).hexdigest() for k, v in objs.items()} == want


def test_two_voters_of_three_back_without_their_logs_is_a_clear_state(cluster):  # type: ignore
    """Beyond what the group survives (two of three voters lose their disks at once): no
    leader can be elected, and the voter that holds the log says so, in its log and in
    `objcache status`, instead of waiting in silence."""
    a, b, c = nodes = _three(cluster)
    want = sorted(m.status()["cluster"]["raft"]["self"] for m in (a, b))
    for m in (a, b):
        m.kill9()
        shutil.rmtree(m.cache)
        m.extra = (*m.extra, "--catch-up-seconds", "2")
    threads = [threading.Thread(target=_restart_wiped, args=(m, nodes)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(m.status()["cluster"]["raft"].get("voting") is False for m in (a, b))
    _wait(lambda: c.status()["cluster"]["raft"].get("without_log") == want, 20,
          "the voter with the log names the voters without theirs")
    out = objcache("status", str(c.mnt))
    assert "NO LEADER CAN BE ELECTED" in out.stdout, out.stdout
    assert "came back without their logs" in c.log_path.read_text()


def test_drain_to_zero_then_a_fresh_node_sees_everything(cluster, s3, bucket, mounts,
                                                        seaweed, tmp_path):  # type: ignore
    nodes = _three(cluster)
    want: dict[str, bytes] = {}
    for i, m in enumerate(nodes):
        os.makedirs(m.mnt / f"dir{i}" / "sub", exist_ok=True)
        for j in range(25):
            data = os.urandom(100 + 7919 * j)
            (m.mnt / f"dir{i}" / "sub" / f"f{j}").write_bytes(data)
            want[f"dir{i}/sub/f{j}"] = data
    os.makedirs(nodes[0].mnt / "empty")
    os.symlink("dir0/sub/f1", nodes[1].mnt / "link")
    for m in nodes:
        t0 = time.monotonic()
        out = objcache("drain", str(m.mnt), timeout=300)
        assert out.returncode == 0, out.stderr
        assert "drained" in out.stdout
        assert m.wait_exit(60) == 0
        print(f"drain of {m.mnt.name}: {time.monotonic() - t0:.2f}s")
    objs = _objects(s3, bucket)
    assert {k: v for k, v in objs.items() if k.startswith("dir") and k[-1] != "/"} == want
    assert "empty/" in objs and objs["link"] == b"dir0/sub/f1"
    fresh = Mount(seaweed.endpoint, bucket, tmp_path / "fresh", tmp_path / "fresh-cache")
    mounts.append(fresh)
    fresh.start()
    assert sorted(os.listdir(fresh.mnt)) == ["dir0", "dir1", "dir2", "empty", "link"]
    assert (fresh.mnt / "dir2" / "sub" / "f24").read_bytes() == want["dir2/sub/f24"]
    assert os.readlink(fresh.mnt / "link") == "dir0/sub/f1"


def test_quorum_loss_fails_with_eio_in_bounded_time(cluster):  # type: ignore[no-untyped-def]
    nodes = [cluster.add(*WB, "--txn-timeout", "4") for _ in range(5)]
    cluster.wait_raft(nodes, 5, timeout=60)
    (nodes[0].mnt / "before").write_bytes(b"x")
    for m in nodes[2:]:
        m.kill9()
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        os.mkdir(nodes[0].mnt / "during")
    assert e.value.errno == errno.EIO
    assert time.monotonic() - t0 < 15
    # Reads still work from what the survivors have.
    assert (nodes[1].mnt / "before").read_bytes() == b"x"
    # The dead come back from their logs: the cluster commits again.
    for m in nodes[2:]:
        m.start()
    cluster.wait_raft(nodes, 5, timeout=90)
    os.mkdir(nodes[0].mnt / "after")
    assert _wait(lambda: all((m.mnt / "after").is_dir() for m in nodes), what="mkdir")


def test_sigterm_with_a_key_s3_refuses_finishes_and_quarantines(cluster, s3, bucket, proxy,
                                                                tmp_path):  # type: ignore
    """S3 refuses one key for good: SIGTERM of each node (a Kubernetes scale-down) still
    finishes; everything else reaches S3 and the refused bytes are in a lost+found/."""
    proxy.refuse("bad.bin")
    a, b = cluster.add(*WB), cluster.add(*WB)
    cluster.wait_raft([a, b], 2)
    data = os.urandom(2 * MiB)
    (a.mnt / "good1").write_bytes(b"one")
    (b.mnt / "bad.bin").write_bytes(data)
    (a.mnt / "good2").write_bytes(b"two")
    for m in (b, a):
        t0 = time.monotonic()
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        assert m.wait_exit(90) == 0
        print(f"SIGTERM of {m.mnt.name}: exited in {time.monotonic() - t0:.2f}s")
    objs = _objects(s3, bucket)
    assert objs.get("good1") == b"one" and objs.get("good2") == b"two"
    assert "bad.bin" not in objs
    notes = list(tmp_path.rglob("lost+found/*.json"))
    assert len(notes) == 1, notes
    note = json.loads(notes[0].read_text())
    assert note["key"] == "bad.bin"
    assert (notes[0].parent / note["data"]).read_bytes() == data


def _restart(m: Mount, *flags: str) -> Mount:
    """Start a killed member again with its address, Raft port and cache dir, with `flags`
    (FLAG VALUE pairs) replacing or added to what it had."""
    extra = list(m.extra)
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag in extra:
            extra[extra.index(flag) + 1] = value
        else:
            extra += [flag, value]
    m.extra = tuple(extra)
    return m.start(timeout=60)


def test_a_member_restarted_before_the_others_writes_back_and_flush_never_hangs(
        cluster, s3, bucket):  # type: ignore[no-untyped-def]
    """Everything killed; one member comes back alone (no quorum): it mounts after its
    catch-up wait, a flush on it fails in bounded time naming the cause instead of
    hanging; once the others are back, it catches up and writes back what it owns."""
    nodes = _three(cluster)
    want = {f"f{i}": os.urandom(100 + i) for i in range(30)}
    for k, v in want.items():
        (nodes[1].mnt / k).write_bytes(v)
    for m in nodes:
        m.kill9()
    t0 = time.monotonic()
    _restart(nodes[0], "--catch-up-seconds", "2", "--txn-timeout", "3",
             "--writeback-delay", "1")
    assert time.monotonic() - t0 < 30
    t0 = time.monotonic()
    out = objcache("flush", str(nodes[0].mnt), check=False, timeout=60)
    assert out.returncode != 0 and "caught up" in out.stderr, out
    assert time.monotonic() - t0 < 20
    for m in nodes[1:]:
        _restart(m, "--writeback-delay", "1")
    _wait(lambda: {k: v for k, v in _objects(s3, bucket).items() if k in want} == want,
          timeout=60, what="every file written back")
    assert all(m.status()["dirty"]["files"] == 0 for m in nodes)
    out = objcache("flush", str(nodes[0].mnt), check=False, timeout=60)
    assert out.returncode == 0, out.stderr


def test_an_open_reader_keeps_its_version_when_another_node_overwrites(
        cluster):  # type: ignore[no-untyped-def]
    """B overwrites a file that C has open and half read: C's handle goes on reading the
    version it opened, whole (its size too), or gets ESTALE, never mixed or cut bytes; a
    new open on C sees the new version."""
    b, c = cluster.add(*WB), cluster.add(*WB)
    cluster.wait_raft([b, c], 2)
    rng = random.Random(7)
    for i in range(8):
        old = os.urandom(rng.choice([3, 2, 1]) * MiB + rng.randrange(4096))
        new = os.urandom(rng.choice([1, 2, 4]) * MiB + rng.randrange(4096))
        (b.mnt / "f").write_bytes(old)
        with open(c.mnt / "f", "rb") as f:
            head = f.read(MiB // 2)
            (b.mnt / "f").write_bytes(new)
            time.sleep(0.05)  # C has applied the change
            try:
                rest = f.read()
                assert head + rest == old, (i, len(old), len(new), len(head + rest))
                assert os.fstat(f.fileno()).st_size == len(old)
            except OSError as e:
                assert e.errno == errno.ESTALE, e
        assert (c.mnt / "f").read_bytes() == new


def test_a_directory_rename_is_atomic_to_listings_on_other_nodes(
        cluster):  # type: ignore[no-untyped-def]
    """A renames a 100-entry directory back and forth while B lists both names: every
    listing is the whole directory or ENOENT, never part of it, never empty."""
    a, b = cluster.add(*WB), cluster.add(*WB)
    cluster.wait_raft([a, b], 2)
    (a.mnt / "x").mkdir()
    for i in range(100):
        (a.mnt / "x" / f"f{i:03d}").write_bytes(b"x")
    want = sorted(f"f{i:03d}" for i in range(100))
    stop = threading.Event()
    bad: list[tuple[str, int]] = []
    listings = 0

    def lister() -> None:
        nonlocal listings
        while not stop.is_set():
            for name in ("x", "y"):
                try:
                    got = sorted(os.listdir(b.mnt / name))
                except FileNotFoundError:
                    continue
                listings += 1
                if got != want:
                    bad.append((name, len(got)))

    t = threading.Thread(target=lister)
    t.start()
    try:
        for i in range(16):
            os.rename(a.mnt / ("x" if i % 2 == 0 else "y"), a.mnt / ("y" if i % 2 == 0 else "x"))
            time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
    assert listings > 50
    assert not bad, bad[:10]
