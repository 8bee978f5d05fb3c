"""A real SeaweedFS S3 server on 127.0.0.1 for tests, with enforced credentials."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ACCESS_KEY = "objcache-test"
SECRET_KEY = "objcache-test-secret"


def free_port_block(count: int) -> int:
    """A base port such that base..base+count-1 and their +10000 gRPC twins are free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count + 10000 >= 65535:
            continue
        ok = True
        for p in [base + i for i in range(count)] + [base + 10000 + i for i in range(count)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


PORTS = 6  # s3, master, volume, filer, admin, webdav: base .. base + 5


class SeaweedFS:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        weed = shutil.which("weed") or str(Path(os.sys.executable).parent / "weed")
        data = self.workdir / "weed"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        base = free_port_block(PORTS)
        self.port = base
        # glog writes weed.* logs to /tmp unless told (three or more files a server).
        args = [weed, f"-logdir={self.workdir}", "mini", f"-dir={data}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-s3.config={cfg}", f"-s3.port={base}", f"-master.port={base + 1}",
                f"-volume.port={base + 2}", f"-filer.port={base + 3}",
                f"-admin.port={base + 4}", f"-webdav.port={base + 5}", "-webdav=false",
                # Fixed-port side services (8181, 9101) would collide between servers.
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                # Every bucket is a collection that grows its own volumes: the default
                # (free disk / 128 MB) ran out after ~45 test buckets on a fuller disk.
                "-volume.max=3000",
                "-admin.ui=false"]
        self.log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: see {self.workdir / 'weed.log'}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
            except urllib.error.HTTPError:
                break  # it answers (403 without credentials)
            except OSError:
                time.sleep(0.2)
                continue
            break
        else:
            raise RuntimeError("SeaweedFS did not come up within 60s")
        # The S3 gateway answers before the filer is ready for writes: wait for a bucket.
        client = self.client()
        for _ in range(100):
            try:
                client.create_bucket(Bucket="warmup")
                client.put_object(Bucket="warmup", Key="k", Body=b"x")
                return
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("SeaweedFS S3 never accepted a write")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, access: str = ACCESS_KEY, secret: str = SECRET_KEY):  # type: ignore
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=access,
                            aws_secret_access_key=secret, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"mode": "standard", "max_attempts": 5}))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed leaves a unix socket per service in /tmp (seaweedfs-s3-PORT.sock,
        seaweedfs-volume-grpc-PORT.sock, ...), named by the service's port or its gRPC
        twin (+10000), and never removes them: this server's go with it."""
        if not self.port:
            return
        ours = {self.port + i + grpc for i in range(PORTS) for grpc in (0, 10000)}
        for sock in {p for d in ("/tmp", tempfile.gettempdir())
                     for p in Path(d).glob("seaweedfs-*.sock")}:
            port = sock.name.removesuffix(".sock").rpartition("-")[2]
            if port.isdigit() and int(port) in ours:
                sock.unlink(missing_ok=True)
