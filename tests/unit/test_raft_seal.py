"""Raft frames are sealed with the cluster secret (objcache.raft.guard.FrameSeal): a member
answers a connection whose first frame carries the secret's seal, with a frame sealed the
same way, and closes one whose first frame was sealed with another secret (or encrypted
by an older objcache, which it names in its log)."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from objcache.raft.guard import BadFrame, FrameSeal
from objcache.raft.node import RaftNode
from objcache.txn.state import ClusterState
from tests.helpers.cluster import free_port

SECRET = "k" * 32


def _frame(seal: FrameSeal, message: Any) -> bytes:
    """A frame as pysyncobj's TcpConnection sends it."""
    data = seal.encrypt_at_time(zlib.compress(pickle.dumps(message), 3), int(time.monotonic()))
    return struct.pack("i", len(data)) + data


def _recv_frame(sock: socket.socket) -> bytes | None:
    """The next frame's bytes, or None once the member closed the connection."""
    buf = b""
    while True:
        if len(buf) >= 4 and len(buf) - 4 >= struct.unpack("i", buf[:4])[0]:
            return buf[4:4 + struct.unpack("i", buf[:4])[0]]
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            return None
        if not more:
            return None
        buf += more


def test_a_frame_opens_only_with_the_secret_that_sealed_it() -> None:
    seal = FrameSeal(SECRET)
    frame = seal.encrypt_at_time(b"payload", 7)
    assert seal.extract_timestamp(frame) == 7
    assert bytes(seal.decrypt(frame)) == b"payload"
    assert b"payload" in frame  # sealed, not encrypted
    with pytest.raises(BadFrame):
        FrameSeal("j" * 32).extract_timestamp(frame)
    tampered = bytearray(frame)
    tampered[9] ^= 1
    with pytest.raises(BadFrame):
        seal.extract_timestamp(bytes(tampered))
    with pytest.raises(BadFrame):
        seal.decrypt(frame[:20])


def test_a_member_answers_only_frames_sealed_with_the_cluster_secret(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    node = RaftNode(addr, [addr], tmp_path / "m0", SECRET, ClusterState())
    try:
        deadline = time.monotonic() + 10
        while True:  # pysyncobj binds its port on its own thread
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the member never listened"
                time.sleep(0.05)
        # pysyncobj's key exchange: our random key in, the member's own key back (every
        # frame after the first carries the key of the side it goes to)
        mine = os.urandom(32)
        with sock:
            sock.sendall(_frame(FrameSeal(SECRET), mine))
            got = _recv_frame(sock)
            assert got is not None, "the member closed a connection sealed with its secret"
            seal = FrameSeal(SECRET)
            seal.extract_timestamp(got)
            echoed, theirs = pickle.loads(zlib.decompress(seal.decrypt(got)))
            assert echoed == mine and isinstance(theirs, bytes) and len(theirs) == 32
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(_frame(FrameSeal("j" * 32), os.urandom(32)))
            assert _recv_frame(sock) is None
        # a member of an older version (pysyncobj's Fernet tokens) is named in the log
        with caplog.at_level(logging.ERROR, "objcache.raft.guard"), \
                socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            token = b"gAAAAA" + os.urandom(90)
            sock.sendall(struct.pack("i", len(token)) + token)
            assert _recv_frame(sock) is None
        assert any("older than this one" in r.getMessage() for r in caplog.records)
    finally:
        node.destroy()
