"""`objcache csi-node`: the CSI v1 node plugin (Identity and Node services over gRPC).

Each Kubernetes node runs one objcache daemon per bucket, mounted under `--mount-root`
(the DaemonSet does that). Publishing a volume bind-mounts that mount, or a sub-path of it,
into the pod's target path, read-only when asked. Which mount a volume uses comes from its
volume context (`mount`, default: the volume id; `subPath`, optional), so a static PV and a
CSI ephemeral inline volume are handled alike. Publish and unpublish are idempotent, as
the spec requires, and invalid requests get the status codes the spec names.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import signal
import threading
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import wrappers_pb2

from objcache import CTRL_NAME, __version__
from objcache.csi import csi_pb2 as pb
from objcache.csi import csi_pb2_grpc as pbg
from objcache.errors import UserError

log = logging.getLogger(__name__)

DRIVER_NAME = "csi.objcache.io"
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src: str | None, target: str, flags: int) -> None:
    if _libc.mount(src.encode() if src else None, target.encode(), None,
                   ctypes.c_ulong(flags), None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {target}: {os.strerror(e)}")


def _umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(target.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def mounts() -> dict[str, tuple[str, str, bool]]:
    """Mount point -> (device number "major:minor", root within it, read-only)."""
    out: dict[str, tuple[str, str, bool]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            out[point] = (fields[2], fields[3].encode().decode("unicode_escape"),
                          "ro" in fields[5].split(","))
    return out


def _abort(ctx: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> Any:
    log.info("%s: %s", code.name, msg)
    ctx.abort(code, msg)


def _require(ctx: grpc.ServicerContext, request: Any, *fields: str) -> None:
    """INVALID_ARGUMENT for the first required field the request leaves empty."""
    for name in fields:
        if not getattr(request, name):
            _abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"{name} is missing")


class Identity(pbg.IdentityServicer):
    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def GetPluginInfo(self, request: Any, context: Any) -> Any:  # gRPC method names
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:
        # No Controller service: volumes are static or inline, attachRequired is false.
        return pb.GetPluginCapabilitiesResponse()

    def Probe(self, request: Any, context: Any) -> Any:
        ready = os.path.isdir(self.plugin.mount_root)
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=ready))


class Node(pbg.NodeServicer):
    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin
        self._lock = threading.Lock()  # publish/unpublish of one node, one at a time

    def NodeGetInfo(self, request: Any, context: Any) -> Any:
        return pb.NodeGetInfoResponse(node_id=self.plugin.node_id)

    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:
        rpc = pb.NodeServiceCapability.RPC
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=rpc(type=rpc.GET_VOLUME_STATS)),
            pb.NodeServiceCapability(rpc=rpc(type=rpc.VOLUME_CONDITION))])

    def _source(self, request: Any, context: Any) -> str:
        ctx = dict(request.volume_context)
        name = ctx.get("mount") or request.volume_id
        if "/" in name or name in ("", ".", ".."):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"volume {request.volume_id}: invalid mount name {name!r}")
        root = os.path.join(self.plugin.mount_root, name)
        if not os.path.exists(os.path.join(root, CTRL_NAME)):
            _abort(context, grpc.StatusCode.NOT_FOUND,
                   f"volume {request.volume_id}: no objcache mount {name!r} on this node "
                   f"(under {self.plugin.mount_root})")
        sub = ctx.get("subPath", "").strip("/")
        src = os.path.realpath(os.path.join(root, sub))
        if not (src == root or src.startswith(root + "/")):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"volume {request.volume_id}: subPath {sub!r} leaves the mount")
        if not os.path.isdir(src):
            _abort(context, grpc.StatusCode.NOT_FOUND,
                   f"volume {request.volume_id}: subPath {sub!r} is not a directory in "
                   f"mount {name!r}")
        return src

    @staticmethod
    def _bind(src: str, target: str, readonly: bool) -> None:
        _mount(src, target, MS_BIND)
        if readonly:
            _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY)

    def NodePublishVolume(self, request: Any, context: Any) -> Any:
        _require(context, request, "volume_id", "target_path")
        if not request.HasField("volume_capability"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is missing")
        if request.volume_capability.HasField("block"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   "objcache volumes are filesystems: block access is not supported")
        src = self._source(request, context)
        target = request.target_path
        readonly = request.readonly or request.volume_capability.access_mode.mode in (
            pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
            pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY)
        with self._lock:
            current = mounts().get(target)
            if current is not None:
                want = os.stat(src).st_dev
                same = os.stat(target).st_dev == want and current[2] == readonly
                if same:
                    return pb.NodePublishVolumeResponse()  # published already: a no-op
                _abort(context, grpc.StatusCode.ALREADY_EXISTS,
                       f"{target} is already published with another source or mode")
            try:
                os.makedirs(target, exist_ok=True)
                self._bind(src, target, readonly)
            except OSError as e:
                if target in mounts():
                    _umount(target, MNT_DETACH)
                _abort(context, grpc.StatusCode.INTERNAL, f"cannot publish {src}: {e}")
            self.plugin.published[target] = {"src": src, "readonly": readonly}
            self.plugin.save()
        log.info("published %s at %s%s", src, target, " (read-only)" if readonly else "")
        return pb.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:
        _require(context, request, "volume_id", "target_path")
        target = request.target_path
        with self._lock:
            try:
                while target in mounts():  # stacked binds from retried publishes, too
                    try:
                        _umount(target)
                    except OSError as e:
                        if e.errno not in (errno.EBUSY, errno.ENOTCONN):
                            raise
                        _umount(target, MNT_DETACH)  # busy or dead: detach lazily
                if os.path.isdir(target):
                    os.rmdir(target)
            except OSError as e:
                _abort(context, grpc.StatusCode.INTERNAL, f"cannot unpublish {target}: {e}")
            if self.plugin.published.pop(target, None) is not None:
                self.plugin.save()
        log.info("unpublished %s", target)
        return pb.NodeUnpublishVolumeResponse()

    def NodeGetVolumeStats(self, request: Any, context: Any) -> Any:
        _require(context, request, "volume_id", "volume_path")
        path = request.volume_path
        if not os.path.lexists(path):
            _abort(context, grpc.StatusCode.NOT_FOUND, f"{path} does not exist")
        try:
            st = os.statvfs(path)
        except OSError as e:
            # The daemon behind the mount is gone: report it, kubelet surfaces the event.
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(
                abnormal=True, message=f"{path}: {e.strerror}"))
        unit = pb.VolumeUsage
        return pb.NodeGetVolumeStatsResponse(usage=[
            unit(unit=unit.BYTES, total=st.f_blocks * st.f_frsize,
                 available=st.f_bavail * st.f_frsize,
                 used=(st.f_blocks - st.f_bfree) * st.f_frsize),
            unit(unit=unit.INODES, total=st.f_files, available=st.f_favail,
                 used=st.f_files - st.f_ffree)],
            volume_condition=pb.VolumeCondition(abnormal=False, message="mounted"))


class NodePlugin:
    """The plugin's state: where it serves, and what it published (kept in a file beside
    the socket, so a restarted plugin still repairs the volumes it published before)."""

    def __init__(self, endpoint: str, node_id: str, mount_root: str) -> None:
        if not endpoint.startswith("unix://"):
            raise UserError(f"invalid --endpoint {endpoint!r}: expected unix:///PATH")
        self.socket_path = endpoint[len("unix://"):]
        self.node_id = node_id
        self.mount_root = os.path.realpath(mount_root)
        self.state_path = os.path.join(os.path.dirname(self.socket_path) or ".",
                                       "published.json")
        self.published: dict[str, dict[str, Any]] = {}
        try:
            with open(self.state_path) as f:
                self.published = json.load(f)
        except (OSError, ValueError):
            pass
        self.node = Node(self)

    def save(self) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.published, f)
        os.replace(tmp, self.state_path)

    def repair(self) -> int:
        """Re-point published volumes whose objcache daemon was restarted.

        A bind mount keeps the FUSE connection of the daemon that served it; when that
        daemon dies (crash, pod restart, upgrade) the pod's volume answers ENOTCONN. Once
        a new daemon serves the same mount, the stale bind is detached and bound again;
        with HostToContainer propagation on the pod's volumeMount the running container
        sees the new mount. Returns how many volumes were repaired."""
        repaired = 0
        with self.node._lock:
            for target, info in list(self.published.items()):
                src, readonly = info["src"], bool(info["readonly"])
                try:
                    os.statvfs(target)  # (stat may answer from cached attributes)
                    continue  # healthy
                except FileNotFoundError:
                    continue  # unpublished behind our back; kubelet will tell us
                except OSError as e:
                    if e.errno != errno.ENOTCONN:
                        log.debug("volume %s: %s", target, e)
                        continue
                try:
                    os.stat(os.path.join(src, CTRL_NAME))
                except OSError as e:
                    log.debug("volume %s is down, its mount too: %s", target, e)
                    continue  # no new daemon yet: try again on the next round
                try:
                    while target in mounts():
                        _umount(target, MNT_DETACH)
                    self.node._bind(src, target, readonly)
                except OSError as e:
                    log.error("could not re-publish %s at %s: %s", src, target, e)
                    continue
                log.warning("re-published %s at %s after its daemon restarted", src, target)
                repaired += 1
        return repaired

    def start(self) -> grpc.Server:
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a previous run of the plugin
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pbg.add_IdentityServicer_to_server(Identity(self), server)
        pbg.add_NodeServicer_to_server(self.node, server)
        if not server.add_insecure_port(f"unix://{self.socket_path}"):
            raise UserError(f"cannot listen on {self.socket_path}")
        server.start()
        log.info("CSI node plugin %s for node %s on %s (mounts under %s)", DRIVER_NAME,
                 self.node_id, self.socket_path, self.mount_root)
        return server


def run(endpoint: str, node_id: str, mount_root: str, repair_interval: float = 2.0) -> int:
    plugin = NodePlugin(endpoint, node_id, mount_root)
    server = plugin.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(repair_interval):
        try:
            plugin.repair()
        except Exception:
            log.exception("repairing published volumes failed")
    server.stop(grace=5).wait()
    return 0
