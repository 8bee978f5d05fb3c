"""Object metadata fetched once, on real mounts, counted at a proxy in front of SeaweedFS:
`ls -l` after a restart and on a second node makes no HEAD (what a HEAD said is kept by
object version in the state database and by the key's owner); an object another client
changed is still seen within --metadata-ttl; random stats cost one request each."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from tests.helpers.mount import Mount

FILES = 300


def _ls_l(path: os.PathLike[str]) -> dict[str, str]:
    out = subprocess.run(["ls", "-l", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return {ln.split()[-1]: ln for ln in out.splitlines()[1:]}


def _fill(s3, bucket: str) -> None:  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: s3.put_object(
            Bucket=bucket, Key=f"d/f{i:04d}", Body=b"x" * i,
            Metadata={"mode": str(stat.S_IFREG | 0o640), "uid": "1234"}), range(FILES)))


def test_a_restarted_mount_lists_without_heads_and_sees_changes(s3, bucket, proxy, mounts,
                                                                tmp_path):  # type: ignore
    _fill(s3, bucket)

    def start() -> Mount:
        m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache",
                  "--metadata-ttl", "2")
        mounts.append(m)
        return m.start()

    m = start()
    proxy.reset()
    lines = _ls_l(m.mnt / "d")
    assert lines["f0007"].startswith("-rw-r-----") and lines["f0007"].split()[2] == "1234"
    assert proxy.requests["HEAD"] >= FILES - 5, proxy.requests  # cold: S3 lists no metadata
    time.sleep(1.5)  # written to the state database within a second (or at exit)
    m.stop()
    m = start()  # the same cache dir
    proxy.reset()
    lines = _ls_l(m.mnt / "d")
    assert len(lines) == FILES and lines["f0007"].startswith("-rw-r-----")
    assert proxy.requests["HEAD"] <= 1, proxy.requests  # ("d" itself: a file named d?)
    assert proxy.requests["LIST"] <= 3, proxy.requests
    # another client changes one object (new bytes, new mode) and only the metadata of
    # another (copied onto itself: same ETag, new Last-Modified)
    time.sleep(1.1)
    s3.put_object(Bucket=bucket, Key="d/f0008", Body=b"new",
                  Metadata={"mode": str(stat.S_IFREG | 0o600)})
    s3.copy_object(Bucket=bucket, Key="d/f0009", CopySource={"Bucket": bucket,
                   "Key": "d/f0009"}, Metadata={"mode": str(stat.S_IFREG | 0o604)},
                   MetadataDirective="REPLACE")
    time.sleep(2.5)  # --metadata-ttl
    lines = _ls_l(m.mnt / "d")
    assert lines["f0008"].startswith("-rw-------") and lines["f0008"].split()[4] == "3"
    assert lines["f0009"].startswith("-rw----r--"), lines["f0009"]
    assert lines["f0007"].startswith("-rw-r-----")
    assert not m.errors_in_log()


def test_a_second_node_lists_without_heads(s3, bucket, proxy, cluster):  # type: ignore
    _fill(s3, bucket)
    a, b = cluster.add(), cluster.add()
    cluster.wait_members([a, b], 2)
    _ls_l(a.mnt / "d")
    time.sleep(1.5)  # the answers reach the keys' owners
    proxy.reset()
    lines = _ls_l(b.mnt / "d")
    assert len(lines) == FILES and lines["f0011"].startswith("-rw-r-----")
    assert proxy.requests["HEAD"] <= 1, proxy.requests
    assert not a.errors_in_log() and not b.errors_in_log()


def test_random_stats_cost_one_request_each(s3, bucket, proxy, mounts, tmp_path):  # type: ignore
    keys = [f"r{j:02d}/{k:03d}" for j in range(20) for k in range(100)]
    keys += [f"big/{k:04d}" for k in range(2000)]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=b"r"), keys))
    m = Mount(proxy.endpoint, bucket, tmp_path / "mnt", tmp_path / "cache")
    mounts.append(m)
    m.start()
    for d in {k.partition("/")[0] for k in keys}:
        os.listdir(m.mnt / d)
    picks = random.Random(5).sample(keys, 600)
    proxy.reset()
    for k in picks:
        os.stat(m.mnt / k)
    time.sleep(1)  # whatever was fetched ahead is counted too
    total = sum(proxy.requests.values())
    assert total <= 1.1 * len(picks), proxy.requests
