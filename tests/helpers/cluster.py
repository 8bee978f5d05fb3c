"""A cluster of objcache daemons as separate processes on 127.0.0.1 (tests, benchmarks), or
each on a test host of its own (tests/helpers/netns.py)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Protocol

from tests.helpers.mount import Mount

_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port on 127.0.0.1 not handed out before in this process: the kernel may give
    a just-closed port again, and two members on one address share a journal."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class Hosts(Protocol):
    """Where node i runs: its address, the command prefix that runs it there, and its S3
    endpoint (tests/helpers/netns.py's test hosts)."""

    def ip(self, i: int) -> str: ...
    def wrap(self, i: int) -> tuple[str, ...]: ...
    def endpoint(self, i: int) -> str: ...


class Cluster:
    """objcache daemons as separate processes on 127.0.0.1, sharing one bucket and secret,
    each with its own mountpoint, cache dir and peer port (or on `hosts`)."""

    def __init__(self, endpoint: str, bucket: str, root: Path, mounts: list[Mount],
                 hosts: Hosts | None = None) -> None:
        self.endpoint, self.bucket, self.root, self._mounts = endpoint, bucket, root, mounts
        self.hosts = hosts
        self.secret = root / "cluster.key"
        self.secret.write_text(os.urandom(32).hex())
        self.secret.chmod(0o600)
        self.nodes: list[Mount] = []
        self.addrs: list[str] = []

    def add(self, *extra: str, secret: Path | None = None, start: bool = True,
            peers: str | None = None) -> Mount:
        i = len(self.nodes)
        h = self.hosts
        addr = f"{h.ip(i) if h else '127.0.0.1'}:{free_port()}"
        peers = ",".join(self.addrs) if peers is None else peers
        flags = ["--listen", addr, "--raft-port", str(free_port()),
                 "--cluster-secret-file", str(secret or self.secret),
                 "--cache-size", "1G", "--peer-timeout", "3", *extra]
        if peers:
            flags += ["--peers", peers]
        m = Mount(h.endpoint(i) if h else self.endpoint, self.bucket, self.root / f"mnt{i}",
                  self.root / f"cache{i}", *flags, wrap=h.wrap(i) if h else ())
        m.addr = addr  # type: ignore[attr-defined]
        self._mounts.append(m)
        self.nodes.append(m)
        self.addrs.append(addr)
        return m.start() if start else m

    def wait_landed(self, nodes: list[Mount], timeout: float = 20) -> list[dict]:  # type: ignore[type-arg]
        """Until no node in `nodes` has chunks on their way to its cache disk (a read
        is answered from memory before the chunk it read is written); their statuses."""
        deadline = time.monotonic() + timeout
        while True:
            stats = [n.status() for n in nodes]
            landing = [st["cache"]["chunks_landing"] for st in stats]
            if not any(landing):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"chunks still landing after {timeout}s: {landing}")
            time.sleep(0.1)

    def wait_raft(self, nodes: list[Mount], members: int, timeout: float = 30) -> list[dict]:  # type: ignore[type-arg]
        """Until the nodes agree on one Raft group of `members` with one leader."""
        deadline = time.monotonic() + timeout
        while True:
            rafts = [n.status()["cluster"]["raft"] for n in nodes]
            if (all(r is not None and len(r["members"]) == members and not r.get("promoting")
                    for r in rafts)
                    and len({r["leader"] for r in rafts}) == 1 and rafts[0]["leader"]
                    and len({r["term"] for r in rafts}) == 1):
                return rafts
            if time.monotonic() > deadline:
                raise AssertionError(f"raft views: {rafts}")
            time.sleep(0.3)

    def wait_members(self, nodes: list[Mount], alive: int, timeout: float = 20) -> None:
        """Until every node in `nodes` sees `alive` live members (itself included)."""
        deadline = time.monotonic() + timeout
        while True:
            counts = [sum(1 for m in n.status()["cluster"]["members"]
                          if m["state"] in ("self", "alive", "suspect")) for n in nodes]
            if all(c == alive for c in counts):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"members seen: {counts}, wanted {alive} each")
            time.sleep(0.2)
