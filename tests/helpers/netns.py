"""Test hosts of our own: every daemon in its own network namespace, with its own address,
cut off from its peers and healed with iptables inside those namespaces.

Layout of one `TestNet` (run id R = the test process's pid, so a later run can tell a dead
run's namespaces from a live one's and remove them):

    ocp-R-hub   the bridge `ocpbrR`, and one end of each node's veth pair
    ocp-R-n0 .. ocp-R-nN-1   a node: `lo` and `eth0` = 10.213.1.(10+i)/24 on the bridge

Nothing is created outside these namespaces: no address, interface or firewall rule in the
machine's own namespace, so deleting the namespaces removes everything (`close()`, also
called at exit and by the next run for runs whose process is gone). The iptables rules of
a cut live in the namespace of the node they filter.

S3 stays on the machine's loopback (SeaweedFS); each node reaches it through its own proxy
(tests/helpers/s3proxy.py), whose listening socket is made inside the node's namespace
(`entered`), so the daemon's endpoint is 127.0.0.1:PORT on its own loopback. A node loses
S3 while its peers keep it by a DROP of that port in its namespace (`cut_s3`); the proxy
also injects 503s and stalls (`CountingProxy.fail_next`, `stall_next`).

Daemons are started through `nsenter --net=/run/netns/NAME` (`wrap`), not `ip netns exec`,
which would also give them a mount namespace of their own and hide their FUSE mounts.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.helpers.s3proxy import CountingProxy

PREFIX = "ocp"
SUBNET = "10.213.1"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_setns_lock = threading.Lock()


def why_not() -> str | None:
    """Why this machine cannot make the test hosts (None if it can)."""
    for tool in ("ip", "iptables", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs it)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}-probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", name, "iptables", "-w", "-S"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"iptables cannot run in a network namespace: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def ours() -> list[str]:
    """Our namespaces on this machine (every run's)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"{PREFIX}-")]


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a test killed with -9)."""
    gone = []
    for name in ours():
        m = re.match(rf"{PREFIX}-(\d+)-", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _sh("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the block with this thread in network namespace `ns` (sockets made in it stay
    there; threads started later start in the namespace their creator is in then)."""
    with _setns_lock, open(f"/run/netns/{ns}") as target, \
            open(f"/proc/self/task/{threading.get_native_id()}/ns/net") as home:
        if _libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            yield
        finally:
            if _libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")


class TestNet:
    """N hosts on one bridge. Links are cut per direction: `drop(a, b)` drops what a
    sends to b (in a's namespace, OUTPUT) and what a receives from b is untouched."""

    def __init__(self, n: int) -> None:
        remove_stale()
        self.run = str(os.getpid())
        self.n = n
        self.hub = f"{PREFIX}-{self.run}-hub"
        self.bridge = f"{PREFIX}br{self.run}"[:15]
        self.names = [f"{PREFIX}-{self.run}-n{i}" for i in range(n)]
        self.dropped: set[tuple[int, int]] = set()
        self.s3_cut: dict[int, int] = {}  # node -> proxy port dropped
        self.proxies: list[CountingProxy] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _sh("ip", "netns", "add", self.hub)
        _sh("ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer",
                "name", "eth0", "netns", ns)
            _sh("ip", "-n", self.hub, "link", "set", f"v{i}", "master", self.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def start_s3(self, upstream_port: int) -> None:
        """One S3 proxy per host, listening on that host's loopback."""
        from tests.helpers.s3proxy import CountingProxy
        for ns in self.names:
            with entered(ns):
                proxy = CountingProxy(upstream_port)
            self.proxies.append(proxy.start())

    def endpoint(self, i: int) -> str:
        return self.proxies[i].endpoint

    def wrap(self, i: int) -> tuple[str, ...]:
        """The command prefix that runs a program on host i."""
        return ("nsenter", f"--net=/run/netns/{self.names[i]}")

    def _ipt(self, i: int, *rule: str) -> None:
        _sh("ip", "netns", "exec", self.names[i], "iptables", "-w", *rule)

    # -- links ----------------------------------------------------------------------------

    def drop(self, a: int, b: int) -> None:
        """a's packets to b are lost (one way)."""
        if (a, b) not in self.dropped:
            self._ipt(a, "-A", "OUTPUT", "-d", self.ip(b), "-j", "DROP")
            self.dropped.add((a, b))

    def undrop(self, a: int, b: int) -> None:
        if (a, b) in self.dropped:
            self._ipt(a, "-D", "OUTPUT", "-d", self.ip(b), "-j", "DROP")
            self.dropped.discard((a, b))

    def cut(self, a: int, b: int) -> None:
        self.drop(a, b)
        self.drop(b, a)

    def cut_s3(self, i: int, port: int) -> None:
        """Host i's S3 proxy (on its loopback) becomes unreachable: connects time out."""
        if i not in self.s3_cut:
            self._ipt(i, "-A", "OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port),
                      "-j", "DROP")
            self.s3_cut[i] = port

    def heal(self) -> None:
        """Every link and every S3 path back."""
        for a, b in list(self.dropped):
            self.undrop(a, b)
        for i, port in list(self.s3_cut.items()):
            self._ipt(i, "-D", "OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port),
                      "-j", "DROP")
            del self.s3_cut[i]

    def reaches(self, a: int, b: int) -> bool:
        """Whether a and b can talk (TCP needs both directions)."""
        return (a, b) not in self.dropped and (b, a) not in self.dropped

    def close(self) -> None:
        """Delete every namespace of this run (their veths, bridge and rules go with them)."""
        if self._closed:
            return
        self._closed = True
        for proxy in getattr(self, "proxies", []):
            proxy.stop()
        for ns in [*getattr(self, "names", []), self.hub]:
            _sh("ip", "netns", "del", ns, check=False)
