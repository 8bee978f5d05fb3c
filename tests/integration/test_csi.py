"""The CSI node plugin over a real Unix socket with a gRPC client, publishing a real
objcache mount (bind mounts need root, as the plugin does in its DaemonSet)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from objcache.csi import csi_pb2 as pb
from objcache.csi import csi_pb2_grpc as pbg
from tests.helpers.mount import Mount, env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")

AM = pb.VolumeCapability.AccessMode


def _mounted(path: Path) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == str(path))


@pytest.fixture
def plugin(s3, bucket, seaweed, mounts, tmp_path) -> Iterator[tuple]:  # type: ignore
    s3.put_object(Bucket=bucket, Key="data/train.txt", Body=b"epoch data")
    s3.put_object(Bucket=bucket, Key="readme.txt", Body=b"hello")
    root = tmp_path / "mounts"
    m = Mount(seaweed.endpoint, bucket, root / "datasets", tmp_path / "cache")
    mounts.append(m)
    m.start()
    sock = tmp_path / "csi" / "csi.sock"
    log = open(tmp_path / "csi.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen([sys.executable, "-m", "objcache", "csi-node", "--endpoint",
                             f"unix://{sock}", "--node-id", "node-a", "--mount-root",
                             str(root), "--log-level", "debug"], env=env(), stderr=log)
    targets: list[Path] = []
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "csi.log").read_text()
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"unix://{sock}")
        yield pbg.IdentityStub(channel), pbg.NodeStub(channel), tmp_path / "pods", targets, m
        channel.close()
    finally:
        for t in [*targets, *(tmp_path / "pods").glob("*/*")]:
            while _mounted(t):
                subprocess.run(["umount", "-l", str(t)], capture_output=True)
        proc.terminate()
        proc.wait(10)
        log.close()


def _cap(mode: int = AM.SINGLE_NODE_WRITER, block: bool = False) -> pb.VolumeCapability:
    if block:
        return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                   access_mode=AM(mode=mode))
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                               access_mode=AM(mode=mode))


def test_identity_and_node_info(plugin) -> None:  # type: ignore
    identity, node, _, _, _ = plugin
    assert identity.Probe(pb.ProbeRequest()).ready.value is True
    info = identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "csi.objcache.io" and info.vendor_version
    assert not identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest()).capabilities
    assert node.NodeGetInfo(pb.NodeGetInfoRequest()).node_id == "node-a"
    caps = {c.rpc.type for c in node.NodeGetCapabilities(
        pb.NodeGetCapabilitiesRequest()).capabilities}
    assert pb.NodeServiceCapability.RPC.GET_VOLUME_STATS in caps
    assert pb.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME not in caps


def test_publish_is_idempotent_and_unpublish_removes_it(plugin) -> None:  # type: ignore
    _, node, pods, targets, _ = plugin
    target = pods / "pod-1" / "vol"
    targets.append(target)
    req = pb.NodePublishVolumeRequest(volume_id="datasets", target_path=str(target),
                                      volume_capability=_cap())
    node.NodePublishVolume(req)
    assert sorted(os.listdir(target)) == ["data", "readme.txt"]
    assert (target / "readme.txt").read_bytes() == b"hello"
    (target / "from-pod.txt").write_text("written in the pod")
    node.NodePublishVolume(req)  # again: a no-op
    assert _mounted(target) == 1

    stats = node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id="datasets", volume_path=str(target)))
    assert stats.usage[0].unit == pb.VolumeUsage.BYTES and stats.usage[0].total > 0
    assert not stats.volume_condition.abnormal

    unreq = pb.NodeUnpublishVolumeRequest(volume_id="datasets", target_path=str(target))
    node.NodeUnpublishVolume(unreq)
    assert _mounted(target) == 0 and not target.exists()
    node.NodeUnpublishVolume(unreq)  # again: still fine


def test_inline_volume_with_subpath_read_only(plugin) -> None:  # type: ignore
    _, node, pods, targets, _ = plugin
    target = pods / "pod-2" / "vol"
    targets.append(target)
    # An ephemeral inline volume: kubelet makes up the id; the context names the mount.
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="csi-0f3a9c", target_path=str(target), volume_capability=_cap(),
        readonly=True, volume_context={"mount": "datasets", "subPath": "data"}))
    assert os.listdir(target) == ["train.txt"]
    assert (target / "train.txt").read_bytes() == b"epoch data"
    with pytest.raises(OSError) as e:
        (target / "new.txt").write_text("x")
    assert e.value.errno == 30  # EROFS
    # The same target with another mode is a conflict.
    with pytest.raises(grpc.RpcError) as err:
        node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="csi-0f3a9c", target_path=str(target), volume_capability=_cap(),
            volume_context={"mount": "datasets", "subPath": "data"}))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("req,code", [
    (dict(target_path="/tmp/x", volume_capability=_cap()), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(volume_id="datasets", volume_capability=_cap()), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(volume_id="datasets", target_path="/tmp/x"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(volume_id="datasets", target_path="/tmp/x", volume_capability=_cap(block=True)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(volume_id="nope", target_path="/tmp/x", volume_capability=_cap()),
     grpc.StatusCode.NOT_FOUND),
    (dict(volume_id="datasets", target_path="/tmp/x", volume_capability=_cap(),
          volume_context={"subPath": "missing"}), grpc.StatusCode.NOT_FOUND),
    (dict(volume_id="datasets", target_path="/tmp/x", volume_capability=_cap(),
          volume_context={"subPath": "../../etc"}), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_publish_requests(plugin, req, code) -> None:  # type: ignore
    _, node, _, _, _ = plugin
    with pytest.raises(grpc.RpcError) as err:
        node.NodePublishVolume(pb.NodePublishVolumeRequest(**req))
    assert err.value.code() == code, err.value.details()
    assert not Path("/tmp/x").exists() or not _mounted(Path("/tmp/x"))


def test_volumes_come_back_after_the_daemon_restarts(plugin, seaweed, bucket, s3,  # type: ignore
                                                     mounts, tmp_path) -> None:
    _, node, pods, targets, daemon = plugin
    target = pods / "pod-3" / "vol"
    targets.append(target)
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="datasets", target_path=str(target), volume_capability=_cap()))
    assert (target / "readme.txt").read_bytes() == b"hello"

    assert daemon.proc is not None
    daemon.proc.kill()  # the daemon pod dies; its mount and the pod's bind stay behind
    daemon.proc.wait(10)
    with pytest.raises(OSError) as e:
        os.listdir(target)
    assert e.value.errno == 107  # ENOTCONN

    # The restarted daemon takes the dead mountpoint over; the plugin re-binds the volume.
    new = Mount(seaweed.endpoint, bucket, daemon.mnt, tmp_path / "cache", "--recover-mount")
    mounts.append(new)
    new.start()
    s3.put_object(Bucket=bucket, Key="after-restart.txt", Body=b"new daemon")
    deadline = time.monotonic() + 20
    while True:
        try:
            names = os.listdir(target)
            break
        except OSError:
            assert time.monotonic() < deadline, "the volume was not repaired"
            time.sleep(0.2)
    assert "after-restart.txt" in names
    assert (target / "readme.txt").read_bytes() == b"hello"
    assert _mounted(target) == 1


def test_bad_unpublish_and_stats_requests(plugin) -> None:  # type: ignore
    _, node, _, _, _ = plugin
    for req in (pb.NodeUnpublishVolumeRequest(target_path="/tmp/x"),
                pb.NodeUnpublishVolumeRequest(volume_id="datasets")):
        with pytest.raises(grpc.RpcError) as err:
            node.NodeUnpublishVolume(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="datasets",
                                                             volume_path="/nonexistent/v"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_path="/tmp"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
