"""Mount s3fs-fuse (the Debian package) on a test bucket, to check that a bucket reads the
same through both. Cleaned up like our own mounts: lazy unmount, then the process by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY


@contextmanager
def s3fs_mount(endpoint: str, bucket: str, work: Path) -> Iterator[Path]:
    mnt = work / f"s3fs-{time.monotonic_ns()}"
    mnt.mkdir(parents=True)
    creds = work / "s3fs.passwd"
    creds.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
    creds.chmod(0o600)
    log = open(work / "s3fs.log", "ab")  # noqa: SIM115
    p = subprocess.Popen(["s3fs", bucket, str(mnt), "-f", "-o",
                          f"url={endpoint},use_path_request_style,passwd_file={creds}"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"s3fs did not mount (see {work / 's3fs.log'})")
            time.sleep(0.1)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        log.close()
