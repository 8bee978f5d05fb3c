"""Directories of small files through a real mount, counted at the S3 server (a counting
proxy in front of SeaweedFS): reading them costs one GET per file (the metadata comes
with the bytes), `ls -l` one HEAD per file and no GET, and neither loses what only a HEAD
can tell (objcache's symlinks and modes)."""

from __future__ import annotations

import os
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor

from objcache.core.filesystem import RELIST_AFTER_STALE_LOOKUPS
from tests.helpers.mount import Mount, objcache

FILES = 300


def test_small_files_cost_one_request_each(s3, bucket, proxy, mounts, tmp_path):  # type: ignore
    bodies = {f"f{i:04d}": os.urandom(1000 + i) for i in range(FILES)}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket=bucket, Key=f"d/{kv[0]}", Body=kv[1]),
                      bodies.items()))
    writer = Mount(proxy.endpoint, bucket, tmp_path / "w", tmp_path / "wcache")
    mounts.append(writer)
    writer.start()
    os.symlink("f0001", writer.mnt / "d" / "link")
    (writer.mnt / "d" / "secret").write_bytes(b"s" * 100)
    os.chmod(writer.mnt / "d" / "secret", 0o600)
    objcache("flush", str(writer.mnt))
    writer.stop()

    def fresh(name: str) -> Mount:
        m = Mount(proxy.endpoint, bucket, tmp_path / name, tmp_path / f"{name}-cache")
        mounts.append(m)
        m.start()
        proxy.reset()
        return m

    ls = fresh("ls")
    assert os.listdir(ls.mnt) == ["d"]
    assert len(os.listdir(ls.mnt / "d")) == FILES + 2
    assert proxy.requests["HEAD"] == 0, proxy.requests  # names only: no metadata asked
    out = subprocess.run(["ls", "-l", str(ls.mnt / "d")], capture_output=True, text=True,
                         check=True).stdout
    lines = {ln.split()[-1] if "->" not in ln else ln.split()[-3]: ln
             for ln in out.splitlines()[1:]}
    assert len(lines) == FILES + 2
    assert lines["link"].startswith("l") and lines["link"].endswith("-> f0001")
    assert lines["secret"].startswith("-rw-------")
    assert lines["f0007"].split()[4] == "1007"
    assert proxy.requests["HEAD"] <= FILES + 2 + 5, proxy.requests
    assert proxy.requests["GET_OBJECT"] <= 2, proxy.requests  # the symlink's target

    rd = fresh("rd")
    names = sorted(bodies)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda n: (rd.mnt / "d" / n).read_bytes(), names))
    assert got == [bodies[n] for n in names]
    assert os.readlink(rd.mnt / "d" / "link") == "f0001"
    assert stat.S_IMODE(os.stat(rd.mnt / "d" / "secret").st_mode) == 0o600
    assert proxy.requests["GET_OBJECT"] <= FILES + 5, proxy.requests
    # lookups answered one by one before the directory is listed, and those of the 8
    # readers before their first open
    assert proxy.requests["HEAD"] <= RELIST_AFTER_STALE_LOOKUPS + 8 + 5, proxy.requests
    assert not rd.errors_in_log() and not ls.errors_in_log()
