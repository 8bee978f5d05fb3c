"""Bad input gets one clear line, a non-zero exit, within seconds, and nothing mounted."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tests.helpers.mount import env, is_mounted, objcache
from tests.helpers.seaweed import SECRET_KEY


def _mount_fails(args: list[str], environ: dict[str, str] | None = None,
                 within: float = 15) -> str:
    t0 = time.monotonic()
    r = objcache("mount", *args, check=False, environ=environ, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, r
    assert elapsed < within, elapsed
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert SECRET_KEY not in r.stderr and "wrong-secret" not in r.stderr
    return lines[0]


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    p = tmp_path / "mnt"
    p.mkdir()
    return p


def test_missing_bucket(seaweed, mnt, tmp_path):  # type: ignore
    msg = _mount_fails(["s3://no-such-bucket-xyz", str(mnt), "--endpoint-url",
                        seaweed.endpoint, "--cache-dir", str(tmp_path / "c")])
    assert "no-such-bucket-xyz" in msg and "does not exist" in msg
    assert not is_mounted(mnt)


def test_wrong_credentials(seaweed, bucket, mnt, tmp_path):  # type: ignore
    msg = _mount_fails([f"s3://{bucket}", str(mnt), "--endpoint-url", seaweed.endpoint,
                        "--cache-dir", str(tmp_path / "c")],
                       environ=env("objcache-test", "wrong-secret"))
    assert "denied" in msg and bucket in msg and "credentials" in msg
    assert not is_mounted(mnt)


def test_unreachable_endpoint(mnt, tmp_path):  # type: ignore
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    msg = _mount_fails(["s3://bkt", str(mnt), "--endpoint-url", f"http://127.0.0.1:{port}",
                        "--cache-dir", str(tmp_path / "c")], within=30)
    assert "cannot reach" in msg and f"127.0.0.1:{port}" in msg


def test_non_empty_and_busy_mountpoint(seaweed, bucket, tmp_path, mount):  # type: ignore
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    msg = _mount_fails([f"s3://{bucket}", str(full), "--endpoint-url", seaweed.endpoint,
                        "--cache-dir", str(tmp_path / "c1")])
    assert "not empty" in msg
    m = mount()
    msg = _mount_fails([f"s3://{bucket}", str(m.mnt), "--endpoint-url", seaweed.endpoint,
                        "--cache-dir", str(tmp_path / "c2")])
    assert "busy" in msg
    other = tmp_path / "other"
    other.mkdir()
    msg = _mount_fails([f"s3://{bucket}", str(other), "--endpoint-url", seaweed.endpoint,
                        "--cache-dir", str(m.cache)])
    assert "in use" in msg


def test_bad_sizes_and_config(mnt, tmp_path):  # type: ignore
    assert "invalid cache-size" in _mount_fails(["s3://b", str(mnt), "--cache-size", "lots"])
    assert "chunk-size" in _mount_fails(["s3://b", str(mnt), "--chunk-size", "1M"])
    cfg = tmp_path / "c.toml"
    cfg.write_text('cache-size = "1G"\nmystery-option = 3\n')
    assert "unknown config key 'mystery-option'" in _mount_fails(
        ["s3://b", str(mnt), "--config", str(cfg)])
    cfg.write_text("cache-size = [\n")
    assert "not valid TOML" in _mount_fails(["s3://b", str(mnt), "--config", str(cfg)])
    assert "s3://" in _mount_fails(["bucket-without-scheme", str(mnt)])


def test_config_file_sets_every_flag(seaweed, bucket, tmp_path, mounts):  # type: ignore
    from tests.helpers.mount import Mount
    cfg = tmp_path / "objcache.toml"
    cfg.write_text(f'endpoint-url = "{seaweed.endpoint}"\ncache-dir = "{tmp_path / "cc"}"\n'
                   'cache_size = "64M"\nchunk-size = "8M"\nwriteback-delay = 2\n'
                   'read-only = true\nlog-level = "debug"\n')
    mnt = tmp_path / "m"
    mnt.mkdir()
    objcache("mount", f"s3://{bucket}", str(mnt), "--config", str(cfg))
    m = Mount(seaweed.endpoint, bucket, mnt, tmp_path / "cc")
    mounts.append(m)
    st = m.status()
    assert st["cache"]["capacity_bytes"] == 64 << 20
    with pytest.raises(OSError):
        (mnt / "nope").write_text("read-only")
    objcache("umount", str(mnt))


def test_cli_on_a_path_that_is_not_a_mount(tmp_path):  # type: ignore
    r = objcache("status", str(tmp_path), check=False)
    assert r.returncode != 0 and "not inside an objcache mount" in r.stderr
    r = objcache("umount", str(tmp_path), check=False)
    assert r.returncode != 0 and "not mounted" in r.stderr


def test_more_bad_input_gets_one_line(mnt, tmp_path):  # type: ignore
    """Each refused before anything starts, with one line naming the cause (no traceback,
    no usage block, no botocore regex)."""
    binary = tmp_path / "bin.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    assert "not TOML" in _mount_fails(["s3://b", str(mnt), "--config", str(binary)])
    assert "--cache-size" in _mount_fails(["s3://b", str(mnt), "--cache-size", "-5G"])
    assert "invalid cache-size '-5G'" in _mount_fails(
        ["s3://b", str(mnt), "--cache-size=-5G"])
    assert "invalid endpoint-url 'not-a-url'" in _mount_fails(
        ["s3://b", str(mnt), "--endpoint-url", "not-a-url"])
    msg = _mount_fails(["s3://Bad_Bucket!!", str(mnt)])
    assert "invalid bucket name 'Bad_Bucket!!'" in msg and "regex" not in msg
    assert "cannot write the log file" in _mount_fails(
        ["s3://b", str(mnt), "--cache-dir", "/proc/objcache-test/c"])


def test_warnings_for_a_huge_cache_size_and_a_readable_secret(seaweed, mnt, tmp_path):  # type: ignore
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o644)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = objcache("mount", "s3://no-such-bucket-xyz", str(mnt), "--endpoint-url",
                 seaweed.endpoint, "--cache-dir", str(tmp_path / "c"), "--cache-size", "100P",
                 "--listen", f"127.0.0.1:{port}", "--cluster-secret-file", str(secret),
                 check=False, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    assert any("warning: cache-size" in ln and "more than the filesystem" in ln
               for ln in lines), r.stderr
    assert any("warning: cluster secret file" in ln and "chmod 600" in ln
               for ln in lines), r.stderr
