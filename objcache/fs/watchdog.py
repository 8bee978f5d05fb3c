"""The FUSE watchdog: a small process that aborts our FUSE connection if the daemon dies
with the mount still in place.

Why: a daemon killed (kill -9, the OOM killer) while one of its threads is telling the
kernel to drop a name (FUSE_NOTIFY_INVAL_ENTRY) can never finish dying. The kernel takes
the directory's lock for that notification, uninterruptibly; the lock's holder is a
request (a create in that directory) waiting for the answer the dead daemon will never
send; and the connection is only aborted once the daemon's /dev/fuse is closed, which the
stuck thread prevents. Every process touching the mount then hangs in D state, the
node's pods with it. Seen in the chaos test (tests/helpers/chaos.py) about once in a few
kills under concurrent creates.

The watchdog holds no /dev/fuse descriptor. The kernel signals it (PR_SET_PDEATHSIG) when
the daemon's main thread exits; if the mount is still there on the same connection, it
writes 1 to /sys/fs/fuse/connections/<id>/abort: the stuck thread and every waiting
process get ENOTCONN, and the mountpoint shows "Transport endpoint is not connected" as
after any crash (docs/operations.md). After a clean unmount it just exits.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CONNECTIONS = Path("/sys/fs/fuse/connections")
PR_SET_PDEATHSIG = 1


def start(mountpoint: str, dev: str) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of the mount at `mountpoint` (device MAJOR:MINOR). Called from
    the daemon's main thread: the kernel signals the watchdog when that thread exits."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "objcache.fs.watchdog", mountpoint, dev,
             str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
    except OSError as e:
        log.warning("could not start the FUSE watchdog (a daemon killed mid-notification "
                    "could leave the mount hung): %s", e)
        return None


def _still_mounted(mountpoint: str, dev: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mountpoint and line.split()[2] == dev for line in f)


def abort_connection(dev: str) -> None:
    """Abort the FUSE connection of device MAJOR:MINOR: whatever waits on it gets
    ENOTCONN. Mounts fusectl for it when it is not mounted, and unmounts it after."""
    mounted_here = False
    if not CONNECTIONS.is_dir() or not any(CONNECTIONS.iterdir()):
        mounted_here = subprocess.run(["mount", "-t", "fusectl", "none", str(CONNECTIONS)],
                                      capture_output=True).returncode == 0
    try:
        (CONNECTIONS / dev.split(":")[1] / "abort").write_text("1")
    finally:
        if mounted_here:
            subprocess.run(["umount", str(CONNECTIONS)], capture_output=True)


def _run() -> None:
    import ctypes

    mountpoint, dev, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Set here rather than between fork and exec in the daemon (a multi-threaded process,
    # where the child may only call async-signal-safe code); blocked first, then armed,
    # then the parent checked, so a daemon dying at any moment is seen.
    wanted = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() == parent:
        signal.sigwait(wanted)
    if _still_mounted(mountpoint, dev):
        try:
            abort_connection(dev)
        except OSError:
            pass


if __name__ == "__main__":
    _run()
