"""Processes put in a CPU cgroup of the idle class for a while: how the scale harness
emulates, on one machine, that the cluster's other nodes have CPUs of their own.

With N daemons on one machine, every daemon's work competes for the same cores, which on a
real cluster it never does: the daemons that a close-to-open round trip does not wait for
(the learners that neither write nor read) take the cores from the ones it waits for. A
scheduling policy per thread (SCHED_IDLE) cannot say which is which here: each daemon is
started in a session of its own, and with the kernel's autogroups (sched_autogroup_enabled,
1 on this machine) each session is a task group scheduled fairly against
the others, so a thread's policy only ranks it inside its own daemon
(`python -m benchmarks.sched_chain` shows both). A cgroup with `cpu.idle` set is the same
class for a whole group: its tasks run when nothing else wants a core.

cgroup v1 (a hierarchy with the cpu controller at /sys/fs/cgroup/cpu) and v2 (the
unified hierarchy at /sys/fs/cgroup with cpu enabled) both have `cpu.idle` (Linux 5.15+).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


class IdleCgroupUnavailable(RuntimeError):
    """No cpu cgroup hierarchy here lets us make a group of the idle class."""


def _hierarchy() -> tuple[Path, str]:
    """The root of a cpu hierarchy, and the key of its lines in /proc/PID/cgroup."""
    if (V1 / "cpu.idle").exists() or (V1 / "cgroup.procs").exists():
        return V1, "cpu"
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2, ""
    raise IdleCgroupUnavailable("no cpu cgroup hierarchy is mounted (/sys/fs/cgroup/cpu "
                                "or a cgroup v2 /sys/fs/cgroup with the cpu controller)")


def _cgroup_of(pid: int, key: str) -> str:
    """The path of `pid`'s cgroup in the hierarchy whose /proc lines have `key`
    (v1: the controller list; v2: the empty one of the line "0::/path")."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (key and key in controllers.split(",")) or (not key and controllers == ""
                                                       and line.startswith("0:")):
            return path
    return "/"


@contextlib.contextmanager
def idle_cgroup(pids: Iterable[int], name: str = "") -> Iterator[Path]:
    """Move every thread of each of `pids` into a new cgroup with `cpu.idle` = 1 for the
    block; each goes back to the cgroup it came from after it (a process that ended
    meanwhile is skipped), and the group is removed, on every way out."""
    root, key = _hierarchy()
    pids = list(pids)
    home = {p: _cgroup_of(p, key) for p in pids}
    group = root / (name or f"objcache-bench-idle-{os.getpid()}")
    try:
        group.mkdir()
    except PermissionError as e:
        raise IdleCgroupUnavailable(f"cannot make a cgroup in {root}: {e}") from None
    try:
        idle = group / "cpu.idle"
        if not idle.exists():
            raise IdleCgroupUnavailable(f"{root} has no cpu.idle (Linux 5.15+ has it)")
        idle.write_text("1")
        for p in pids:
            (group / "cgroup.procs").write_text(str(p))
        yield group
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                (root / home[p].lstrip("/") / "cgroup.procs").write_text(str(p))
        # (a thread created while its process moved could stay behind, and would keep
        # the group from being removed: v1 lists threads in `tasks`)
        tasks = group / "tasks"
        for tid in tasks.read_text().split() if tasks.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                (root / "tasks").write_text(tid)
        group.rmdir()
