"""The partition nemesis: a cluster on test hosts of its own (tests/helpers/netns.py) runs
a workload while links are cut and healed, nodes are killed, stopped and restarted; every
operation is recorded with its start, end and result, and the history is checked, not
only the end state.

Workload (one process per node, `_WORKER`): on shared keys `reg/k*` (registers every node
overwrites), write+close and read; on keys of its own `ns/W-N`, create+write+close, rename
to `ns/W-N.r`, unlink. Every write's bytes are derived from its id (`payload`), so a read
names the write it returns, or shows that it returns bytes nobody wrote.

Nemesis (`Nemesis`): one node isolated, the leader isolated, a majority/minority split,
one-way loss (a node's packets to another, or everything sent to the leader), a bridge
(one node sees both halves, the halves do not see each other), a flapping link, a node
losing S3; and kill -9 with a restart (with its cache dir, or without it), SIGSTOP. Each
fault is healed before the next; the timeline of who reaches whom is recorded.

Checks (`check`), on the history and then after healing, flushing and settling:
- every acknowledged close is byte-exact on every node and in S3 (the last acknowledged
  write of a register, or a later one, never an older one; an item's acknowledged
  create/rename/unlink is what every node and S3 show);
- close-to-open across nodes: a read that starts after a close was acknowledged returns
  those bytes or a write that was not over before that close began;
- no read returns bytes that were never written, or those of a write that answered EIO
  (EIO means it did not, and never will, take effect);
- results other than success and EIO (ETIMEDOUT: the outcome was in doubt, ENOTCONN: the
  daemon was killed) are indeterminate: such a write may or may not have taken effect;
- EIO only when no copy was reachable: an EIO (or ETIMEDOUT) of a read or a change while
  its node reached every other node and S3 (and all ran) is a violation; every EIO is
  reported with how long its node had been cut off, and must come within `bound`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.cluster import Cluster
from tests.helpers.mount import Mount, objcache
from tests.helpers.netns import TestNet

REGS = 6  # shared registers
SIZES = (200, 5000, 300_000)
FLAGS = ("--writeback-delay", "2", "--txn-timeout", "5", "--catch-up-seconds", "5")
TXN_TIMEOUT = 5.0
PEER_TIMEOUT = 3.0  # tests/helpers/cluster.py's --peer-timeout
BARRIER = 3.0  # objcache.txn.coordinator.BARRIER_TIMEOUT: an open's wait for the log
# After a barrier fails, a node serves what it applied for DEGRADED_FOR (5 s): reads on a
# node cut off from the majority within this long may be stale (docs/semantics.md).
STALE_WINDOW = BARRIER + 5.0
S3_RETRY = 60.0  # the daemons' --s3-retry-seconds (default)


def payload(wid: str) -> bytes:
    """The bytes write `wid` writes: its id, then bytes derived from it."""
    rng = random.Random(wid)
    head = wid.encode() + b"|"
    return head + rng.randbytes(rng.choice(SIZES))


# The worker is a process of its own (a thread would leave its open files on the mount
# inherited by every daemon the test restarts). One JSON line per finished operation.
_WORKER = r"""
import errno, json, os, random, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from tests.helpers.partition import REGS, payload, classify
root, tag, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
n = 0
item, step = None, 0  # the ns item being walked: 0 none, 1 created, 2 renamed

def emit(**rec):
    print(json.dumps(rec), flush=True)

def run(kind, key, fn, wid=None):
    t0 = time.time()
    emit(w=tag, op=kind, key=key, wid=wid, t0=t0, begin=True)
    try:
        got = fn()
        res = "ok"
    except OSError as e:
        got, res = None, errno.errorcode.get(e.errno or 0, str(e.errno))
    emit(w=tag, op=kind, key=key, wid=wid, t0=t0, t1=time.time(), res=res, got=got)
    return res

def write(path, data):
    with open(path, "wb") as f:
        f.write(data)

def read(path):
    with open(path, "rb") as f:
        return classify(f.read())

while True:
    n += 1
    r = rng.random()
    if r < 0.45:
        key = f"reg/k{rng.randrange(REGS)}"
        wid = f"{tag}-{n}"
        run("write", key, lambda: write(root / key, payload(wid)), wid)
    elif r < 0.8:
        key = f"reg/k{rng.randrange(REGS)}"
        run("read", key, lambda: read(root / key))
    else:
        if step == 0:
            item = f"ns/{tag}-{n}"
            res = run("create", item, lambda: write(root / item, payload(item)), item)
        elif step == 1:
            res = run("rename", item, lambda: os.rename(root / item, root / (item + ".r")))
        else:
            res = run("unlink", item, lambda: os.unlink(root / (item + ".r")))
        step = (step + 1) % 3 if res == "ok" else 0  # a failed step ends the item
    time.sleep(rng.uniform(0, 0.05))
"""


def classify(data: bytes) -> str:
    """What a read returned: a write id, `prefix:ID:LENGTH` (the first LENGTH bytes of
    that write), `empty`, or `garbage` (bytes no write wrote)."""
    if not data:
        return "empty"
    wid = data.partition(b"|")[0].decode(errors="replace")
    want = payload(wid)
    if data == want:
        return wid
    if want.startswith(data) and b"|" in data:
        return f"prefix:{wid}:{len(data)}"
    return "garbage"


@dataclass
class Op:
    node: int
    w: str
    op: str
    key: str
    t0: float
    t1: float
    res: str
    wid: str | None = None
    got: str | None = None

    @property
    def acked(self) -> bool:
        return self.res == "ok"

    @property
    def failed(self) -> bool:
        """A definite failure: EIO says nothing happened, and nothing will."""
        return self.res == "EIO"


@dataclass
class Event:
    t0: float
    kind: str
    detail: str
    t1: float = 0.0


@dataclass
class Result:
    seed: int
    t_start: float = field(default_factory=time.time)
    ops: list[Op] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    eios: list[str] = field(default_factory=list)  # each EIO, with how long it was cut off
    counts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        c = self.counts
        return (f"{len(self.events)} faults, {c.get('ops', 0)} ops "
                f"({c.get('acked_writes', 0)} writes acknowledged, {c.get('eio', 0)} EIO, "
                f"{c.get('indeterminate', 0)} indeterminate, "
                f"{c.get('stale_reads_cut_off', 0)} stale reads on cut-off nodes, "
                f"{c.get('stale_reads_no_leader', 0)} on nodes cut off from the leader; "
                f"{c.get('cut_short_finals', 0)} registers left empty or a prefix by a "
                f"write cut short), {len(self.errors)} violations")


class Timeline:
    """Who reached whom, who ran and who reached S3, over time (for judging EIOs)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.marks: list[tuple[float, frozenset[tuple[int, int]], frozenset[int],
                               frozenset[int]]] = [(0.0, frozenset(), frozenset(),
                                                    frozenset())]

    def mark(self, net: TestNet, down: set[int]) -> None:
        self.marks.append((time.time(), frozenset(net.dropped), frozenset(down),
                           frozenset(net.s3_cut)))

    def _at(self, t: float) -> int:
        i = 0
        for j, m in enumerate(self.marks):
            if m[0] <= t:
                i = j
        return i

    def whole(self, node: int, t0: float, t1: float) -> bool:
        """Whether over [t0, t1] every link and S3 worked for `node` and all nodes ran."""
        i0, i1 = self._at(t0), self._at(t1)
        for _, dropped, down, s3 in self.marks[i0:i1 + 1]:
            if down or node in s3 or any(node in pair for pair in dropped):
                return False
        return True

    def s3_lost(self, node: int, t0: float, t1: float) -> bool:
        """Whether `node` could not reach S3 at some time in [t0, t1]."""
        i0, i1 = self._at(t0), self._at(t1)
        return any(node in m[3] for m in self.marks[i0:i1 + 1])

    def down_during(self, node: int, t0: float, t1: float) -> bool:
        """Whether `node` was killed or stopped at some time in [t0, t1] (its mount was
        gone: the worker saw the bare mountpoint, or ENOTCONN)."""
        i0, i1 = self._at(t0), self._at(t1)
        return any(node in m[2] for m in self.marks[i0:i1 + 1])

    def cut_off_in(self, node: int, t0: float, t1: float) -> str:
        """How `node` stood during [t0, t1]: cut off from the majority since before t0,
        from some time in it, or not."""
        since = self.cut_off_since(node, t0)
        if since is not None:
            return f"cut off {t0 - since:.1f}s before it began"
        for m in self.marks[self._at(t0) + 1:self._at(t1) + 1]:
            if self.cut_off_since(node, m[0]) is not None:
                return f"cut off {m[0] - t0:.1f}s after it began"
        return "not cut off from the majority"

    def cut_within(self, node: int, t0: float, t1: float) -> bool:
        """Whether `node` was cut off from the majority at some time in [t0, t1]."""
        if self.cut_off_since(node, t0) is not None:
            return True
        return any(self.cut_off_since(node, m[0]) is not None
                   for m in self.marks[self._at(t0) + 1:self._at(t1) + 1])

    def cut_off_since(self, node: int, t: float) -> float | None:
        """Since when (before t) `node` had been without a majority of the nodes
        reachable both ways (itself included), or None if it had one at t."""
        def cut(m: Any) -> bool:
            dropped, down = m[1], m[2]
            if node in down:
                return True
            peers = sum(1 for j in range(self.n) if j != node and j not in down
                        and (node, j) not in dropped and (j, node) not in dropped)
            return peers + 1 <= self.n // 2
        i = self._at(t)
        if not cut(self.marks[i]):
            return None
        while i > 0 and cut(self.marks[i - 1]):
            i -= 1
        return self.marks[i][0]


class Nemesis:
    def __init__(self, net: TestNet, cluster: Cluster, nodes: list[Mount], rng: random.Random,
                 timeline: Timeline, res: Result, kills: bool = True) -> None:
        self.net, self.cluster, self.nodes, self.rng = net, cluster, nodes, rng
        self.timeline, self.res, self.kills = timeline, res, kills
        self.down: set[int] = set()
        self.n = len(nodes)

    def _mark(self) -> None:
        self.timeline.mark(self.net, self.down)

    def _event(self, kind: str, detail: str) -> Event:
        e = Event(time.time(), kind, detail)
        self.res.events.append(e)
        return e

    def leader(self) -> int | None:
        for m in self.nodes:
            try:
                raft = m.status()["cluster"]["raft"]
            except Exception:
                continue
            if raft and raft.get("leader"):
                host = raft["leader"].rpartition(":")[0]
                for i in range(self.n):
                    if self.net.ip(i) == host:
                        return i
        return None

    def _hold(self, lo: float = 2.0, hi: float = 16.0) -> None:
        time.sleep(self.rng.uniform(lo, hi))

    def _isolate(self, group: set[int]) -> None:
        for a in group:
            for b in range(self.n):
                if b not in group:
                    self.net.cut(a, b)

    def step(self) -> None:
        kinds = ["isolate", "isolate-leader", "split", "one-way", "leader-deaf", "bridge",
                 "flap", "s3"]
        if self.kills:
            kinds += ["kill", "kill-wipe", "stop", "isolate+kill"]
        kind = self.rng.choice(kinds)
        rng, n = self.rng, self.n
        if kind in ("isolate", "isolate-leader", "isolate+kill"):
            i = self.leader() if kind == "isolate-leader" else None
            i = rng.randrange(n) if i is None else i
            e = self._event(kind, f"n{i}")
            self._isolate({i})
            self._mark()
            if kind == "isolate+kill":
                time.sleep(rng.uniform(0.5, 2))
                j = rng.choice([x for x in range(n) if x != i])
                e.detail += f", kill -9 n{j}"
                self._kill_restart(j, wipe=False)
            self._hold()
        elif kind == "split":
            minority = set(rng.sample(range(n), (n - 1) // 2))
            self._event(kind, f"{sorted(minority)} | rest")
            self._isolate(minority)
            self._mark()
            self._hold()
        elif kind == "one-way":
            a, b = rng.sample(range(n), 2)
            self._event(kind, f"n{a} -> n{b} lost")
            self.net.drop(a, b)
            self._mark()
            self._hold()
        elif kind == "leader-deaf":
            i = self.leader()
            i = rng.randrange(n) if i is None else i
            self._event(kind, f"everything sent to n{i} lost")
            for j in range(n):
                if j != i:
                    self.net.drop(j, i)
            self._mark()
            self._hold()
        elif kind == "bridge":
            order = list(range(n))
            rng.shuffle(order)
            a, rest = order[0], order[1:]
            left, right = rest[:len(rest) // 2], rest[len(rest) // 2:]
            self._event(kind, f"n{a} bridges {left} and {right}")
            for x in left:
                for y in right:
                    self.net.cut(x, y)
            self._mark()
            self._hold()
        elif kind == "flap":
            a, b = rng.sample(range(n), 2)
            self._event(kind, f"n{a} <-> n{b}")
            t_end = time.time() + rng.uniform(3, 8)
            while time.time() < t_end:
                self.net.cut(a, b)
                self._mark()
                time.sleep(rng.uniform(0.2, 1.0))
                self.net.heal()
                self._mark()
                time.sleep(rng.uniform(0.2, 1.0))
        elif kind == "s3":
            i = rng.randrange(n)
            self._event(kind, f"n{i} loses S3")
            self.net.cut_s3(i, self.net.proxies[i].port)
            self._mark()
            self._hold()
        elif kind in ("kill", "kill-wipe"):
            i = rng.randrange(n)
            self._event(kind, f"n{i}")
            self._kill_restart(i, wipe=kind == "kill-wipe")
        elif kind == "stop":
            i = rng.randrange(n)
            self._event(kind, f"SIGSTOP n{i}")
            m = self.nodes[i]
            assert m.proc is not None
            os.kill(m.proc.pid, signal.SIGSTOP)
            self.down.add(i)
            self._mark()
            self._hold(1, 4)
            os.kill(m.proc.pid, signal.SIGCONT)
            self.down.discard(i)
        self.net.heal()
        self._mark()
        self.res.events[-1].t1 = time.time()

    def _kill_restart(self, i: int, wipe: bool) -> None:
        m = self.nodes[i]
        self.down.add(i)
        self._mark()
        if not m.kill9():
            self.res.errors.append(f"n{i} did not die within 5 s of kill -9")
        time.sleep(self.rng.uniform(0.2, 1.5))
        if wipe:
            shutil.rmtree(m.cache, ignore_errors=True)
            if "--peers" not in m.extra:
                # The first node was started with no one to join; without its cache dir
                # (its Raft journal and partners) it would form a cluster of its own, as
                # a node configured without --peers does. A deployment gives every node
                # its peers (docs/kubernetes.md).
                m.extra = (*m.extra, "--peers", ",".join(
                    x.addr for x in self.nodes if x is not m))  # type: ignore[attr-defined]
        m.start(timeout=120)
        self.down.discard(i)
        self._mark()


def _collect(i: int, proc: subprocess.Popen[str], ops: list[Op]) -> None:
    """The worker's operations; one it began and never finished (it was killed) is
    recorded as `unfinished`, ending never (it may take effect any time)."""
    assert proc.stdout is not None
    pending: Op | None = None
    for line in proc.stdout:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("begin"):
            pending = Op(i, r["w"], r["op"], r["key"], r["t0"], float("inf"), "unfinished",
                         r.get("wid"))
            continue
        pending = None
        ops.append(Op(i, r["w"], r["op"], r["key"], r["t0"], r["t1"], r["res"], r.get("wid"),
                      r.get("got")))
    if pending is not None:
        ops.append(pending)


def run(net: TestNet, cluster: Cluster, s3: Any, bucket: str, seconds: float, seed: int,
        nodes_n: int = 3, kills: bool = True, workers_per_node: int = 1,
        voters: int | None = None, extra_flags: tuple[str, ...] = ()) -> Result:
    """`voters`: at most this many members vote (--raft-voters); the others are learners.
    `extra_flags`: given to every daemon after the campaign's own."""
    rng = random.Random(seed)
    res = Result(seed)
    voters = min(nodes_n, voters or nodes_n)
    flags = (*FLAGS, "--raft-voters", str(voters), *extra_flags)
    nodes = [cluster.add(*flags) for _ in range(nodes_n)]
    cluster.wait_raft(nodes, voters, timeout=30 + 2 * nodes_n)
    root = nodes[0].mnt
    (root / "reg").mkdir()
    (root / "ns").mkdir()
    ops: list[Op] = []
    for k in range(REGS):  # every register starts with an acknowledged value
        wid = f"init-{k}"
        t0 = time.time()
        (root / "reg" / f"k{k}").write_bytes(payload(wid))
        ops.append(Op(0, "init", "write", f"reg/k{k}", t0, time.time(), "ok", wid))
    timeline = Timeline(nodes_n)
    nemesis = Nemesis(net, cluster, nodes, rng, timeline, res, kills)
    repo = str(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    workers = [(i, subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(m.mnt), f"n{i}w{j}",
         str(rng.randrange(1 << 30)), repo], stdout=subprocess.PIPE, text=True,
        start_new_session=True)) for i, m in enumerate(nodes) for j in range(workers_per_node)]
    readers = [threading.Thread(target=_collect, args=(i, w, ops), daemon=True)
               for i, w in workers]
    for r in readers:
        r.start()
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(0.5, 2.0))
            nemesis.step()
    finally:
        net.heal()
        for m in nodes:
            if m.proc is not None:
                try:
                    os.kill(m.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for _, w in workers:
            w.kill()  # (an operation in progress is not recorded: it is not judged)
        for _, w in workers:
            w.wait(60)
        for r in readers:
            r.join(10)
    timeline.mark(net, set())
    res.ops = ops
    cluster.wait_raft(nodes, voters, timeout=60)
    check(res, nodes, s3, bucket, timeline)
    return res


# -- checking ----------------------------------------------------------------------------


def _listed_size(path: Path) -> int:
    """The size of a file its directory's listing named; -1 if a stat finds it gone."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1

def bound(op: Op, s3_lost: bool = False) -> float:
    """The longest an operation may take before it answers EIO (docs/semantics.md, "A node
    cut off from the majority"): a change tries to commit for --txn-timeout, then settles
    its outcome for as long again; a read waits --peer-timeout for a holder, after the
    peer requests' own timeout. Plus 5 s of slack for a loaded 2-core machine; plus
    --s3-retry-seconds if the node lost S3 meanwhile (an open may HEAD the object, an
    unlink or rename HEADs it, and S3 requests are retried that long)."""
    s3 = S3_RETRY if s3_lost else 0.0  # (a node without S3 retries its requests first)
    if op.op == "read":
        return BARRIER + PEER_TIMEOUT * 2 + 5 + s3
    return BARRIER + 2 * TXN_TIMEOUT + PEER_TIMEOUT * 2 + 5 + s3


def _torn_wid(v: str) -> str:
    """The write an `empty` or `prefix:ID:LENGTH` value was part of ("" if empty)."""
    return v.split(":")[1] if v.startswith("prefix:") else ""


def _allowed_final(v: str, writes: list[Op]) -> str | None:
    """Why register value `v` (a write id) cannot be the final one, or None."""
    by_wid = {w.wid: w for w in writes}
    if v == "empty" or v.startswith("prefix:"):
        # A worker killed at the end of the run with the file open: the kernel's close of
        # its descriptor commits what it had written (as after a crash, a prefix).
        wid = _torn_wid(v)
        # ("unfinished+down": a write begun as the restarted node's mount came up, a moment
        # before the nemesis marked it up again, and cut short when the run ended; seeds
        # 1175 and 1188, where the kernel's close of the killed worker's descriptor
        # committed its O_TRUNC: an empty register)
        cut = [w for w in writes if w.res.startswith("unfinished")
               and (not wid or w.wid == wid)]
        return None if cut else f"{v}, and no write of it was cut short"
    w = by_wid.get(v)
    if w is None:
        return f"bytes of no write ({v})"
    if w.failed:
        return f"the write {v} answered EIO, yet took effect"
    if w.acked:
        later = [x for x in writes if x.acked and x.t0 > w.t1]
        if later:
            return (f"older than acknowledged {later[-1].wid} (written "
                    f"{later[-1].t0 - w.t1:.1f}s after {v} was acknowledged)")
    return None


def _check_read(r: Op, writes: list[Op]) -> str | None:
    got = r.got or ""
    by_wid = {w.wid: w for w in writes}
    if got == "garbage":
        return "bytes no write wrote"
    if got == "empty" or got.startswith("prefix:"):
        wid = _torn_wid(got)
        mine = [w for w in writes if f"n{r.node}" == w.w.partition("w")[0]
                and w.t0 <= r.t1 and (w.t1 >= r.t0) and (not wid or w.wid == wid)]
        return None if mine else f"{got}, with no write of this node in progress"
    w = by_wid.get(got)
    if w is None:
        return f"bytes of unknown write {got}"
    if w.failed:
        return f"bytes of {got}, whose close answered EIO"
    if w.t0 > r.t1:
        return f"bytes of {got}, written after the read ended"
    end = w.t1 if w.acked else float("inf")
    newer = [x for x in writes if x.acked and x.t1 < r.t0 and end < x.t0]
    if newer:
        x = newer[-1]
        return (f"{got}, older than {x.wid} acknowledged {r.t0 - x.t1:.2f}s before the "
                "read began (close-to-open)")
    return None


def _item_states(chain: list[Op]) -> set[str]:
    """The states an ns item may end in after its operations: none (no name), empty
    (created: the create commits at open, and the close failed), full, renamed."""
    state = {"none"}
    for op in chain:
        nxt = {"create": "full", "rename": "renamed", "unlink": "none"}[op.op]
        if op.acked:
            state = {nxt}
            continue
        state = state | ({"empty"} if op.op == "create" else set())
        if not op.failed:
            state = state | {nxt}
        break
    return state


def degraded_times(m: Mount) -> list[float]:
    """When the daemon's read barrier failed (it then serves what it has applied for 5 s),
    from its log (local time, as the daemon writes it)."""
    out = []
    text = m.log_path.read_text(errors="replace") if m.log_path.exists() else ""
    for line in text.splitlines():
        if "no quorum for a read barrier" in line:
            try:
                stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
                out.append(stamp + float("0" + line[19:23]))
            except ValueError:
                continue
    return out


def check(res: Result, nodes: list[Mount], s3: Any, bucket: str, timeline: Timeline) -> None:
    ops = sorted(res.ops, key=lambda o: o.t0)
    degraded = {i: degraded_times(m) for i, m in enumerate(nodes)}
    for o in ops:
        if not o.acked and timeline.down_during(o.node, o.t0, o.t1):
            o.res += "+down"  # its daemon was killed or stopped meanwhile: indeterminate
    writes: dict[str, list[Op]] = {}
    for o in ops:
        if o.op == "write":
            writes.setdefault(o.key, []).append(o)
    res.counts = {"ops": len(ops), "acked_writes": sum(o.acked for o in ops
                                                     if o.op == "write"),
                  "eio": sum(o.failed for o in ops),
                  "indeterminate": sum(not o.acked and not o.failed for o in ops)}
    for o in ops:
        if o.op == "read" and o.acked:
            why = _check_read(o, writes.get(o.key, []))
            if why and "close-to-open" in why and any(
                    o.t0 - STALE_WINDOW <= t <= o.t1 for t in degraded.get(o.node, ())):
                # Documented: a node whose read barrier failed (it could not commit through
                # the log: cut off from the majority, or from the leader) serves what it
                # has applied for 5 s.
                kind = ("stale_reads_cut_off" if timeline.cut_within(
                    o.node, o.t0 - STALE_WINDOW, o.t1) else "stale_reads_no_leader")
                res.counts[kind] = res.counts.get(kind, 0) + 1
                continue
            if why:
                res.errors.append(f"read of {o.key} on n{o.node} at {o.t0 - res.t_start:.2f}s: "
                                  f"{why}")
        if o.res.endswith("+down"):
            continue
        if o.res in ("EIO", "ETIMEDOUT"):
            took = o.t1 - o.t0
            res.eios.append(f"{o.res} {o.op} {o.key} on n{o.node} at {o.t0 - res.t_start:.1f}s"
                            f" after {took:.1f}s; {timeline.cut_off_in(o.node, o.t0, o.t1)}")
            limit = bound(o, timeline.s3_lost(o.node, o.t0, o.t1))
            if took > limit:
                res.errors.append(f"{o.res} of {o.op} {o.key} on n{o.node} after {took:.1f}s "
                                  f"(bound {limit:.0f}s)")
            if timeline.whole(o.node, o.t0 - PEER_TIMEOUT, o.t1):
                # A read needs a holder, a change a leader and a majority: with every node
                # and S3 reachable (and running) for as long as a node takes to notice a
                # peer, neither may fail (an open(O_TRUNC) racing the RELEASE of the last
                # handle answered EIO at once here).
                res.errors.append(f"{o.res} of {o.op} {o.key} on n{o.node} while every "
                                  "node and S3 was reachable")
        if o.res == "ENOENT" and o.op == "read":
            res.errors.append(f"read of {o.key} on n{o.node} at {o.t0 - res.t_start:.2f}s: "
                              "ENOENT (registers always exist)")
    for m in nodes:
        m.status()  # answers: not stuck
    out = objcache("flush", str(nodes[0].mnt), check=False, timeout=300)
    if out.returncode != 0:
        res.errors.append(f"flush failed: {out.stderr.strip()}")
    # Registers: one value everywhere (every node, S3), and an allowed one.
    for k in range(REGS):
        key = f"reg/k{k}"
        seen: dict[str, str] = {}
        for i, m in enumerate(nodes):
            try:
                seen[f"n{i}"] = classify((m.mnt / key).read_bytes())
            except OSError as e:
                seen[f"n{i}"] = f"error {e.errno}"
        try:
            seen["s3"] = classify(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except Exception as e:
            seen["s3"] = f"error {e}"
        if len(set(seen.values())) != 1:
            res.errors.append(f"{key} differs: {seen}")
        if seen.get("s3", "").startswith(("empty", "prefix:")):
            # (allowed after a write cut short: counted, to see how often the rule is used)
            res.counts["cut_short_finals"] = res.counts.get("cut_short_finals", 0) + 1
        for where, v in seen.items():
            why = _allowed_final(v, writes.get(key, []))
            if why:
                res.errors.append(f"{key} on {where}: {why}")
    # Items: what their acknowledged operations left, everywhere.
    chains: dict[str, list[Op]] = {}
    for o in ops:
        if o.op in ("create", "rename", "unlink"):
            chains.setdefault(o.key, []).append(o)
    s3_keys: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="ns/"):
        s3_keys |= {o["Key"][len("ns/"):]: o["Size"] for o in page.get("Contents", [])}
    listings = {f"n{i}": set(os.listdir(m.mnt / "ns")) for i, m in enumerate(nodes)}
    for item, chain in chains.items():
        name = item[len("ns/"):]
        allowed = _item_states(chain)
        full = len(payload(item))
        for where in [*listings, "s3"]:
            if where == "s3":
                src, dst = s3_keys.get(name), s3_keys.get(name + ".r")
            else:
                i = int(where[1:])
                src = (_listed_size(nodes[i].mnt / item) if name in listings[where]
                       else None)
                dst = (_listed_size(nodes[i].mnt / (item + ".r"))
                       if name + ".r" in listings[where] else None)
            if src == -1 or dst == -1:
                # (listed, and gone by its stat: seed 5996 crashed the check here and
                # kept no history)
                state = "listed but not found"
            elif src is None and dst is None:
                state = "none"
            elif src is not None and dst is None:
                state = "full" if src == full else "empty" if src == 0 else f"size {src}"
            elif dst is not None and src is None:
                state = "renamed" if dst == full else f"renamed with size {dst}"
            else:
                state = "both names"
            if state not in allowed:
                res.errors.append(f"{item} on {where}: {state}, expected one of "
                                  f"{sorted(allowed)} after "
                                  + ", ".join(f"{o.op} {o.res}" for o in chain))
