"""The peers users compare objcache with, mounted for a benchmark: s3fs-fuse and rclone
mount (Debian packages; installed here if missing), each with its disk cache on, against
any S3 endpoint (loopback SeaweedFS, or the WAN proxy in front of it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY


def install() -> None:
    for pkg, binary in (("s3fs", "s3fs"), ("rclone", "rclone")):
        if shutil.which(binary) is None:
            subprocess.run(["apt-get", "install", "-y", "-q", pkg], capture_output=True)


def _wait_mounted(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.ismount(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"mount of {path} exited {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not mount")


def _stop(mnt: Path, proc: subprocess.Popen[bytes]) -> None:
    subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def _mounted(argv: list[str], mnt: Path, cache: Path, env: dict[str, str] | None = None
             ) -> Iterator[tuple[Path, int]]:
    mnt.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_mounted(mnt, p)
        yield mnt, p.pid
    finally:
        _stop(mnt, p)
        shutil.rmtree(cache, ignore_errors=True)


def s3fs(endpoint: str, bucket: str, work: Path, tag: str = "s3fs"
         ) -> contextlib.AbstractContextManager[tuple[Path, int]]:
    """s3fs-fuse with a fresh disk cache; (mount point, pid)."""
    mnt, cache = work / f"mnt-{tag}", work / f"cache-{tag}"
    creds = work / "s3fs.passwd"
    creds.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
    creds.chmod(0o600)
    return _mounted(["s3fs", bucket, str(mnt), "-f", "-o",
                     f"url={endpoint},use_path_request_style,passwd_file={creds},"
                     f"use_cache={cache},parallel_count=8,multipart_size=16"], mnt, cache)


def rclone(endpoint: str, bucket: str, work: Path, tag: str = "rclone"
           ) -> contextlib.AbstractContextManager[tuple[Path, int]]:
    """rclone mount with the full VFS cache, fresh; (mount point, pid)."""
    mnt, cache = work / f"mnt-{tag}", work / f"cache-{tag}"
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # plain http
    env.update(RCLONE_CONFIG_B_TYPE="s3", RCLONE_CONFIG_B_PROVIDER="Other",
               RCLONE_CONFIG_B_ENDPOINT=endpoint, RCLONE_CONFIG_B_ACCESS_KEY_ID=ACCESS_KEY,
               RCLONE_CONFIG_B_SECRET_ACCESS_KEY=SECRET_KEY)
    return _mounted(["rclone", "mount", f"b:{bucket}", str(mnt), "--vfs-cache-mode", "full",
                     "--cache-dir", str(cache), "--dir-cache-time", "1h"], mnt, cache, env)
