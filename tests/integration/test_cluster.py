"""A cluster of objcache daemons (separate processes on 127.0.0.1, one SeaweedFS behind a
counting proxy): chunks are striped across nodes, fetched from S3 once per cluster,
served by their owners, and a dead, late or hostile peer never breaks a read."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import threading
import time

from objcache.cluster.ring import Ring, chunk_point

MIB = 1 << 20


def _put_random(s3, bucket: str, key: str, size: int) -> str:  # type: ignore[no-untyped-def]
    data = os.urandom(size)
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    return hashlib.sha256(data).hexdigest()


def _sha(path: os.PathLike[str] | str, pause_at: int = -1,
         paused: threading.Event | None = None, resume: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
            done += len(block)
            if paused is not None and resume is not None and done == pause_at:
                paused.set()
                assert resume.wait(60)
    return h.hexdigest()


def _read_all(paths: list[os.PathLike[str]]) -> list[str]:
    out: list[str] = [""] * len(paths)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = _sha(paths[i])
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def _why(stats: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """What explains a chunk cached away from its owner: each node's cache counters."""
    keys = ("chunks", "chunks_landing", "near_cache_bytes", "peer_fallbacks",
            "bytes_read_from_s3", "bytes_read_from_peers", "bytes_served_to_peers",
            "corrupt_chunks")
    return [{k: st["cache"][k] for k in keys} | {"suspects": [
        m["addr"] for m in st["cluster"]["members"] if m["state"] == "suspect"]}
        for st in stats]


def test_three_nodes_fetch_a_file_from_s3_once(s3, bucket, cluster, proxy):  # type: ignore
    digest = _put_random(s3, bucket, "data/big.bin", 100 * MIB)
    nodes = [cluster.add("--chunk-size", "8M") for _ in range(3)]
    cluster.wait_members(nodes, 3)
    proxy.reset()

    digests = _read_all([n.mnt / "data" / "big.bin" for n in nodes])

    assert digests == [digest] * 3
    fetched = proxy.get_object_bytes
    assert 100 * MIB <= fetched <= 100 * MIB + 2 * 8 * MIB, fetched / MIB
    # (a chunk read from memory may still be on its way to its owner's disk: counted
    # once it is there)
    stats = cluster.wait_landed(nodes)
    # Each of the 13 chunks is cached once in the cluster, by the node the ring names, and
    # every node read the others from their owners.
    etag = s3.head_object(Bucket=bucket, Key="data/big.bin")["ETag"]
    ring = Ring({n.addr: 1 << 30 for n in nodes})  # type: ignore[attr-defined]
    owned = [sum(ring.owner(chunk_point("data/big.bin", etag, i)) == n.addr  # type: ignore
                 for i in range(13)) for n in nodes]
    assert [st["cache"]["chunks"] for st in stats] == owned, (owned, _why(stats))
    for st, mine in zip(stats, owned, strict=True):
        assert st["cache"]["bytes_read_from_peers"] >= (13 - mine) * 8 * MIB - 4 * MIB
        if mine:
            assert st["cache"]["bytes_served_to_peers"] >= 8 * MIB, st["cache"]
        shares = [m["ring_share"] for m in st["cluster"]["members"]]
        assert len(shares) == 3 and abs(sum(shares) - 1) < 0.01 and min(shares) > 0.15
    # Every member's row of `status` carries that member's own figures (a node the ring
    # gave none of the 13 chunks, which happens with some ETags, holds nothing).
    rows = nodes[0].status()["cluster"]["members"]
    owned_by = {n.addr: mine for n, mine in zip(nodes, owned, strict=True)}  # type: ignore
    assert len(rows) == 3 and all(r["stats"]["cache_capacity_bytes"] == 1 << 30
                                  and (r["stats"]["cache_used_bytes"] > 0)
                                  == (owned_by[r["addr"]] > 0) for r in rows), (rows, owned)
    # One Raft group of the three, one leader, the same term, every membership recorded.
    rafts = cluster.wait_raft(nodes, 3)
    assert sorted(r["role"] for r in rafts) == ["follower", "follower", "leader"]
    for n in nodes:
        assert not n.errors_in_log(), n.errors_in_log()


def test_kill9_of_a_node_mid_read_does_not_fail_reads(s3, bucket, cluster):  # type: ignore
    digest = _put_random(s3, bucket, "model.bin", 96 * MIB)
    nodes = [cluster.add("--chunk-size", "8M") for _ in range(3)]
    cluster.wait_members(nodes, 3)
    cluster.wait_raft(nodes, 3)  # all three vote (the victim was promoted)
    victim = nodes[2]
    paused = [threading.Event(), threading.Event()]
    resume = threading.Event()
    results: list[str | BaseException] = ["", ""]

    def reader(i: int) -> None:
        try:
            results[i] = _sha(nodes[i].mnt / "model.bin", 24 * MIB, paused[i], resume)
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(p.wait(60) for p in paused)
    victim.kill9()  # owner of about a third of the chunks, some of them not read yet
    t0 = time.monotonic()
    resume.set()
    for t in threads:
        t.join(120)
    assert results == [digest, digest], results
    assert time.monotonic() - t0 < 60
    # The survivors take the dead node off the ring after --peer-timeout.
    cluster.wait_members(nodes[:2], 2)
    st = nodes[0].status()["cluster"]["members"]
    assert [m["state"] for m in st if m["addr"] == victim.addr] == ["dead"]  # type: ignore
    # And the file stays readable through the two survivors (fresh page cache: reopen).
    assert _read_all([n.mnt / "model.bin" for n in nodes[:2]]) == [digest, digest]
    # Restarted with its cache dir, the node replays its Raft journal and is back in the
    # same group as a voter (a crashed voter is not removed while no learner can take its
    # place): promoted once when it first joined, never again.
    victim.start()
    cluster.wait_members(nodes, 3)
    cluster.wait_raft(nodes, 3)
    log = victim.log_path.read_text()
    assert log.count("raft member") == 2 and log.count("now a voter") == 1, log[-2000:]


def test_late_joiner_reads_without_refetching(s3, bucket, cluster, proxy):  # type: ignore
    digest = _put_random(s3, bucket, "ds/shard.bin", 96 * MIB)
    first = [cluster.add("--chunk-size", "6M") for _ in range(2)]
    cluster.wait_members(first, 2)
    assert _read_all([n.mnt / "ds" / "shard.bin" for n in first]) == [digest] * 2
    assert proxy.get_object_bytes >= 96 * MIB
    proxy.reset()

    late = cluster.add("--chunk-size", "6M")
    cluster.wait_members([*first, late], 3)
    assert _read_all([late.mnt / "ds" / "shard.bin"]) == [digest]

    assert proxy.get_object_bytes == 0, proxy.requests
    cluster.wait_raft([*first, late], 3)  # the late node joined the Raft group too
    # The late node owns its share of the 16 chunks and took them over from their previous
    # owners (ring computed here the way the daemons compute it: ids = addresses, equal
    # capacities).
    etag = s3.head_object(Bucket=bucket, Key="ds/shard.bin")["ETag"]
    ring = Ring({n.addr: 1 << 30 for n in [*first, late]})
    owned = sum(ring.owner(chunk_point("ds/shard.bin", etag, i)) == late.addr
                for i in range(16))
    st = cluster.wait_landed([late])[0]["cache"]
    assert st["chunks"] == owned and st["bytes_read_from_s3"] == 0, (owned, st)
    assert st["bytes_fetched_from_peers"] == 96 * MIB, st  # all of it from the others


def _refused(addr: str, payload: bytes) -> bool:
    """Send `payload` to the peer port; True if the server closes the connection."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        try:
            s.sendall(payload)
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True


def test_wrong_secret_and_garbage_are_refused(s3, bucket, cluster, tmp_path):  # type: ignore
    digest = _put_random(s3, bucket, "f.bin", 20 * MIB)
    a = cluster.add("--chunk-size", "8M")
    b = cluster.add("--chunk-size", "8M")
    cluster.wait_members([a, b], 2)
    addr = a.addr  # type: ignore[attr-defined]

    # Garbage, a frame header announcing 4 GiB, and a silent client: all dropped.
    t0 = time.monotonic()
    assert _refused(addr, os.urandom(256 * 1024))
    assert _refused(addr, struct.pack(">BI", 1, 0xFFFFFFFF))
    assert _refused(addr, b"")
    assert time.monotonic() - t0 < 30

    # The Raft port too: garbage and a frame of nonsense do not disturb the group.
    raft_addr = cluster.wait_raft([a, b], 2)[0]["self"]
    for junk in (os.urandom(64 * 1024), struct.pack(">I", 0x7FFFFFFF) + os.urandom(1024)):
        host, port = raft_addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            time.sleep(0.5)

    # A daemon with another secret cannot join: a clear error and a non-zero exit.
    bad = tmp_path / "bad.key"
    bad.write_text(os.urandom(32).hex())
    intruder = cluster.add("--chunk-size", "8M", secret=bad, start=False, peers=addr)
    try:
        intruder.start()
        raise AssertionError("a node with the wrong secret mounted")
    except AssertionError as e:
        assert "cluster secret rejected" in str(e), str(e)

    # Meanwhile the cluster kept serving.
    assert _read_all([a.mnt / "f.bin", b.mnt / "f.bin"]) == [digest, digest]
    st = a.status()["cluster"]
    assert st["peer_connections_rejected"] >= 4, st
    assert [m["state"] for m in st["members"]].count("alive") == 1
    cluster.wait_raft([a, b], 2)  # still one group with a leader


def test_a_hung_peer_is_routed_around_and_comes_back(s3, bucket, cluster):  # type: ignore
    digest = _put_random(s3, bucket, "f.bin", 48 * MIB)
    nodes = [cluster.add("--chunk-size", "8M") for _ in range(3)]
    cluster.wait_members(nodes, 3)
    hung = nodes[2]
    assert hung.proc is not None
    os.kill(hung.proc.pid, signal.SIGSTOP)  # alive, connections accepted, never answers
    try:
        t0 = time.monotonic()
        assert _read_all([nodes[0].mnt / "f.bin"]) == [digest]
        assert time.monotonic() - t0 < 30
        cluster.wait_members(nodes[:2], 2)
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    cluster.wait_members(nodes, 3)


def _drop_file_pages(path: os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_hot_remote_chunks_are_kept_in_the_near_cache(s3, bucket, cluster):  # type: ignore
    a, b = (cluster.add("--chunk-size", "8M") for _ in range(2))
    cluster.wait_members([a, b], 2)
    # A name whose chunks b owns at least two of (placement is by hash: pick, not hope).
    data = os.urandom(40 * MIB)
    ring = Ring({a.addr: 1 << 30, b.addr: 1 << 30})  # type: ignore[attr-defined]
    for i in range(100):
        key = f"epoch-{i}.bin"
        s3.put_object(Bucket=bucket, Key=key, Body=data)
        etag = s3.head_object(Bucket=bucket, Key=key)["ETag"]
        if sum(ring.owner(chunk_point(key, etag, c)) == b.addr  # type: ignore[attr-defined]
               for c in range(5)) >= 2:
            break
        s3.delete_object(Bucket=bucket, Key=key)
    digest = hashlib.sha256(data).hexdigest()
    path = a.mnt / key
    for _ in range(2):  # two epochs, the page cache losing the file in between
        assert _sha(path) == digest
        _drop_file_pages(path)
    remote = cluster.wait_landed([b])[0]["cache"]["chunks"]
    assert remote >= 1
    deadline = time.monotonic() + 20
    while a.status()["cache"]["near_cache_bytes"] < remote * 8 * MIB:
        assert time.monotonic() < deadline, a.status()["cache"]
        time.sleep(0.2)
    before = a.status()["cache"]["bytes_fetched_from_peers"]
    assert _sha(path) == digest  # the third epoch moves nothing from b: a has it all
    assert a.status()["cache"]["bytes_fetched_from_peers"] == before


def test_a_peer_name_standing_for_several_nodes_is_resolved(s3, bucket, cluster):  # type: ignore
    """As with a Kubernetes headless Service: the name resolves to the members' addresses,
    our own is skipped, the rest are tried."""
    a = cluster.add()
    port = a.addr.rsplit(":", 1)[1]  # type: ignore[attr-defined]
    b = cluster.add(peers=f"localhost:{port}")
    cluster.wait_members([a, b], 2)


def _listening(port: int) -> set[str]:
    """The local addresses a TCP port is listened on (from /proc/net/tcp)."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # LISTEN
                out.add(socket.inet_ntoa(struct.pack("<I", int(ip_hex, 16))))
    return out


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_the_raft_port_resists_idle_floods_and_huge_frames(cluster):  # type: ignore
    """The Raft port binds the --listen host, closes connections that do not authenticate
    within seconds, caps them per address, and drops a frame announcing 2 GiB at once;
    meanwhile the cluster commits."""
    a, b = cluster.add(), cluster.add()
    raft_addr = cluster.wait_raft([a, b], 2)[0]["self"]
    host, port = raft_addr.rsplit(":", 1)
    assert _listening(int(port)) == {"127.0.0.1"}
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
    try:
        t0 = time.monotonic()
        # beyond 16 pending connections from one address, the rest are closed at once
        closed: set[int] = set()
        while len(closed) < 24 and time.monotonic() - t0 < 4:
            closed |= {i for i, s in enumerate(idle) if i not in closed
                       and _closed_by_peer(s, 0.01)}
        assert len(closed) >= 20, len(closed)
        (a.mnt / "during.txt").write_bytes(b"committed")  # a Raft commit meanwhile
        assert (b.mnt / "during.txt").read_bytes() == b"committed"
        # the silent ones go after the authentication deadline (5 s)
        assert all(_closed_by_peer(s, 10) for i, s in enumerate(idle) if i not in closed)
        assert time.monotonic() - t0 < 15
    finally:
        for s in idle:
            s.close()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("i", 0x7FFFFFFF))
        t0 = time.monotonic()
        try:
            for _ in range(200):
                s.sendall(os.urandom(64 * 1024))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed_by_peer(s, 5) and time.monotonic() - t0 < 5
    (a.mnt / "after.txt").write_bytes(b"still committing")
    assert (b.mnt / "after.txt").read_bytes() == b"still committing"
    cluster.wait_raft([a, b], 2)
