"""Mount objcache as a separate daemon process, and always clean up (lazy unmount, then
end the daemon by PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from objcache import control
from objcache.fs.mounting import mount_device
from objcache.fs.watchdog import abort_connection
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY

# OBJCACHE_TEST_PASSTHROUGH=0 runs every mount of the suite with --no-passthrough (the
# daemon serves every read and write), so the whole suite can be run in both modes.
SUITE_FLAGS = (("--no-passthrough",) if os.environ.get("OBJCACHE_TEST_PASSTHROUGH") == "0"
               else ())


def env(access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> dict[str, str]:
    e = dict(os.environ)
    e.update(AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret,
             AWS_DEFAULT_REGION="us-east-1")
    e.pop("AWS_PROFILE", None)
    return e


def objcache(*args: str, check: bool = True, timeout: float = 120,
             environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "objcache", *args], capture_output=True,
                       text=True, timeout=timeout, env=environ or env())
    if check and r.returncode != 0:
        raise AssertionError(f"objcache {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def _status(mnt: str, timeout: float) -> dict[str, Any]:
    got: list[dict[str, Any]] = []
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            got.append(control.request(mnt, {"op": "status", "local": False}))
        except BaseException as e:  # reported below, in the caller's thread
            failed.append(e)

    # A daemon that does not answer blocks the request in the kernel: ask from a thread
    # that teardown's unmount ends, and give up on it after `timeout`.
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout)
    if failed:
        raise AssertionError(f"objcache status {mnt} failed: {failed[0]}") from failed[0]
    if not got:
        raise AssertionError(f"objcache status {mnt} did not answer in {timeout:.0f}s")
    return got[0]


def abort_fuse(path: Path) -> None:
    """Abort the FUSE connection of the mount at `path` (fusectl), failing whatever
    waits on it; what an operator does for a daemon that cannot exit."""
    dev = mount_device(os.path.realpath(path))
    if dev is not None:
        try:
            abort_connection(dev)
        except OSError:
            pass


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


class Mount:
    """One objcache daemon in the foreground as a child process."""

    def __init__(self, endpoint: str, bucket: str, mnt: Path, cache: Path,
                 *extra: str, environ: dict[str, str] | None = None,
                 wrap: tuple[str, ...] = ()) -> None:
        self.endpoint, self.bucket, self.mnt, self.cache = endpoint, bucket, mnt, cache
        self.wrap = wrap  # a prefix that runs the daemon elsewhere (a network namespace)
        self.extra = extra if "--no-passthrough" in extra else extra + SUITE_FLAGS
        self.environ = environ
        self.proc: subprocess.Popen[bytes] | None = None
        mnt.mkdir(parents=True, exist_ok=True)
        self.log_path = cache.parent / f"{cache.name}.log"

    def start(self, timeout: float = 30) -> Mount:
        args = [*self.wrap, sys.executable, "-m", "objcache", "mount", f"s3://{self.bucket}",
                str(self.mnt), "--endpoint-url", self.endpoint, "--cache-dir", str(self.cache),
                "--foreground", "--log-level", "debug", *self.extra]
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.environ or env(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n"
                                     + self.log_path.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError("mount did not appear")
            time.sleep(0.05)
        # The first request completes FUSE's INIT; after it the mount is fully usable.
        os.stat(self.mnt)
        return self

    def status(self, timeout: float = 120) -> dict[str, Any]:
        """The daemon's `objcache status --json`, asked from this process: the same request
        on the control file as the CLI's, without a Python start-up per call (tests poll
        it several times a second per node, and each CLI run cost 0.1 s of CPU on a
        2-core machine the daemons need). Bounded like the CLI run it replaces; the CLI
        itself is covered by test_mount's test_background_mount_and_status."""
        return _status(str(self.mnt), timeout)

    def kill9(self) -> bool:
        """kill -9 the daemon; False if it did not die within 5 s (a thread stuck in the
        kernel on its own mount), in which case its FUSE connection is aborted to end it."""
        assert self.proc is not None
        self.proc.kill()
        died = True
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            died = False
            abort_fuse(self.mnt)
            self.proc.wait(10)
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        return died

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace: float = 30) -> None:
        """Teardown: lazy unmount, then end the daemon by PID (TERM, then KILL after
        `grace` seconds; KILL at once if `grace` is 0)."""
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            if grace > 0:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "log"):
            self.log.close()

    def errors_in_log(self) -> list[str]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end a long harness run through its `finally` blocks, which
    unmount, end the daemons and take the test hosts and the S3 server down. (A run started
    in the background by a non-interactive shell ignores SIGINT, and Python's own SIGTERM
    exits without running them: a stopped campaign left mounts, daemons and network
    namespaces behind.)"""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def stop_all(mounts: list[Mount], grace: float = 0.0) -> None:
    """Tear mounts down at once: lazy unmount, then kill -9 by PID. A test's own assertions
    are done by now, and nothing looks at what a daemon would do on SIGTERM here (drain
    its dirty files to S3, leave the cluster: daemons of a cluster stopped together cannot
    leave it gracefully, each waits for a quorum of the others, which are leaving too);
    a SIGTERM with a 1 s grace cost each cluster test 1 s and the drain's CPU (33 s of
    the suite). Tests of draining and SIGTERM stop their daemons themselves; `grace`
    sends SIGTERM first and waits that long (benchmarks that want a clean exit)."""
    threads = [threading.Thread(target=m.stop, args=(grace,)) for m in mounts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
