"""The Raft port's defences: what objcache.cluster.peers does for the peer port.

pysyncobj's TCP transport, as shipped, binds 0.0.0.0 whatever the node's address, keeps a
connection that never says anything open forever (only traffic checks its timeout),
buffers whatever length a frame header claims (a 2 GiB header makes it collect, and copy,
2 GiB), and stops listening for good when accept() fails (EMFILE). Here:
- frames are sealed (`FrameSeal`): authenticated with the cluster secret, not encrypted,
  like the peer port's (objcache.cluster.wire). pysyncobj's own password mode encrypts
  every message with Fernet (AES, HMAC and base64 both ways, and each received frame
  verified twice): 17% of a leader's samples at 32 nodes, for a confidentiality that the
  same entries do not have where learners fetch them over the peer port;
- the server binds the node's own Raft address (the --listen host);
- a connection must authenticate (its first frame carries the cluster secret's seal) within
  AUTH_SECONDS, or it is closed; at most MAX_PENDING_PER_ADDRESS such connections per
  remote address;
- a frame header is checked before anything is buffered: MAX_FIRST_FRAME before
  authentication, MAX_FRAME after;
- a failed accept() is logged and skipped, never the end of the listener;
- every connection carries a message at least every 1.5 x KEEPALIVE seconds (a keepalive
  when nothing else went on it for KEEPALIVE). pysyncobj closes a
  connection on which nothing was read for `connectionTimeout`, and checks that when it
  next sends or reads, before it does: a link between two followers (they never talk
  while a leader leads) was closed by the first message sent on it, and that message was
  lost. That was a candidate's vote request: after a drained leader handed over, its
  successor's request reached only the old leader, and the election waited for another
  candidate's timeout (0.4-1.4 s) after the reconnection (1 s; docs/operations.md).
These subclasses override pysyncobj 0.3.17's private methods (the version is pinned in
pyproject.toml).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import socket
import struct
import time
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.tcp_server import TcpServer
from pysyncobj.transport import TCPTransport

log = logging.getLogger(__name__)

AUTH_SECONDS = 5.0
MAX_PENDING_PER_ADDRESS = 16
MAX_FIRST_FRAME = 64 << 10  # the first frame is a 32-byte key, sealed
MAX_FRAME = 256 << 20  # commands are at most 16 MiB (appendEntriesBatchSizeBytes)
KEEPALIVE = 1.0  # seconds; well within connectionTimeout (objcache/raft/node.py: 3.5 s)
KEEPALIVE_MESSAGE = {"type": "keepalive"}  # (no type pysyncobj knows: read, then dropped)


_STAMP = struct.Struct(">Q")  # pysyncobj's frame timestamp (whole seconds, monotonic)
_TAG = hashlib.sha256().digest_size
_SEAL_LABEL = b"objcache raft frame seal 1"  # this key seals nothing but Raft frames
# How a Fernet token begins (its version byte, base64): the frames of an objcache from
# before FrameSeal, which encrypted them with pysyncobj's password mode
FERNET_START = b"gAAAAA"
_told_old: set[str] = set()  # peers already reported as running the older format


class BadFrame(Exception):
    """A frame that does not carry the cluster secret's seal."""


class FrameSeal:
    """What pysyncobj calls its encryptor (`encrypt_at_time`, `extract_timestamp`,
    `decrypt`), sealing instead: a frame is its timestamp, its bytes and an HMAC-SHA256 of
    both under a key derived from the cluster secret. pysyncobj drops the connection of a
    frame whose seal is wrong (any exception there), and its per-connection random key
    inside every sealed frame keeps frames of one connection out of another."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.digest(secret.encode(), _SEAL_LABEL, "sha256")
        # pysyncobj asks for a received frame's timestamp, then for its bytes: the frame
        # checked last is not checked again (one pysyncobj thread per seal)
        self._checked: bytes | None = None

    def encrypt_at_time(self, data: bytes, at: int) -> bytes:
        body = _STAMP.pack(at) + data
        return body + hmac.digest(self._key, body, "sha256")

    def _open(self, frame: bytes) -> memoryview:
        view = memoryview(frame)
        if frame is not self._checked:
            if len(view) < _STAMP.size + _TAG or not hmac.compare_digest(
                    hmac.digest(self._key, view[:-_TAG], "sha256"), view[-_TAG:]):
                raise BadFrame("a Raft frame without the cluster secret's seal")
            self._checked = frame
        return view[:-_TAG]

    def extract_timestamp(self, frame: bytes) -> int:
        return int(_STAMP.unpack_from(self._open(frame))[0])

    def decrypt(self, frame: bytes) -> memoryview:
        return self._open(frame)[_STAMP.size:]


class GuardedConnection(TcpConnection):  # type: ignore[misc]
    """An accepted connection whose frame headers are checked before buffering."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted_at = time.monotonic()
        self.authenticated = False
        sock = kwargs.get("socket")
        try:
            self.peer = sock.getpeername()[0] if sock is not None else ""
        except OSError:
            self.peer = ""

    def _TcpConnection__processRead(self) -> bool:
        more = bool(TcpConnection._TcpConnection__processRead(self))
        buf = self._TcpConnection__readBuffer
        if len(buf) >= 4:
            (n,) = struct.unpack("i", buf[:4])
            cap = MAX_FRAME if self.authenticated else MAX_FIRST_FRAME
            if not 0 <= n <= cap:
                log.warning("raft port: dropped a connection from %s announcing a %d-byte "
                            "frame (limit %d)", self.peer or "?", n, cap)
                self.disconnect()
                return False
            if not self.authenticated and buf[4:4 + len(FERNET_START)] == FERNET_START:
                if self.peer not in _told_old:
                    _told_old.add(self.peer)
                    log.error("raft port: %s sends Fernet-encrypted frames: it runs an objcache "
                              "older than this one, whose Raft frames are sealed; run every "
                              "member on one version", self.peer or "?")
                self.disconnect()
                return False
        return more


class GuardedServer(TcpServer):  # type: ignore[misc]
    """Accepts GuardedConnections; a failed accept() is not the end of the listener."""

    def _TcpServer__onNewConnection(self, descr: int, event: int) -> None:
        if event & POLL_EVENT_TYPE.READ:
            try:
                sock, _ = self._TcpServer__socket.accept()
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    log.warning("raft port: accept failed: %s", e.strerror)
                return
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                self._TcpServer__sendBufferSize)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF,
                                self._TcpServer__recvBufferSize)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                conn = GuardedConnection(
                    poller=self._TcpServer__poller, socket=sock,
                    timeout=self._TcpServer__connectionTimeout,
                    sendBufferSize=self._TcpServer__sendBufferSize,
                    recvBufferSize=self._TcpServer__recvBufferSize,
                    keepalive=self._TcpServer__keepalive)
            except OSError as e:
                log.warning("raft port: could not set up a connection: %s", e.strerror)
                sock.close()
                return
            self._TcpServer__onNewConnectionCallback(conn)
        if event & POLL_EVENT_TYPE.ERROR:
            log.warning("raft port: the listening socket reported an error")


class GuardedTransport(TCPTransport):  # type: ignore[misc]
    """pysyncobj's TCP transport with the defences above (SyncObj's transportClass)."""

    _keepalive_at = 0.0  # (monotonic) when the links are next looked at for keepalives

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (monotonic) when each node was last sent a message: a leader's links carry its
        # appends and their answers several times a second, and need no keepalive
        self._sent_at: dict[Any, float] = {}
        super().__init__(*args, **kwargs)

    def send(self, node: Any, message: Any) -> bool:
        sent = bool(super().send(node, message))
        if sent:
            self._sent_at[node] = time.monotonic()
        return sent

    def _createServer(self) -> None:
        conf = self._syncObj.conf
        host, port = (conf.bindAddress or self._selfNode.address).rsplit(":", 1)
        self._server = GuardedServer(self._syncObj._poller, host.strip("[]"), port,
                                     onNewConnection=self._onNewIncomingConnection,
                                     sendBufferSize=conf.sendBufferSize,
                                     recvBufferSize=conf.recvBufferSize,
                                     connectionTimeout=conf.connectionTimeout)

    def _onNewIncomingConnection(self, conn: GuardedConnection) -> None:
        pending = sum(1 for c in self._unknownConnections
                      if isinstance(c, GuardedConnection) and c.peer == conn.peer)
        if pending >= MAX_PENDING_PER_ADDRESS:
            log.warning("raft port: %s has %d connections that have not authenticated; "
                        "refusing another", conn.peer, pending)
            conn.disconnect()
            return
        super()._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:
        # Only a frame sealed with the cluster secret gets here.
        if isinstance(conn, GuardedConnection):
            conn.authenticated = True
        super()._onIncomingMessageReceived(conn, message)

    def _onTick(self) -> None:
        super()._onTick()
        now = time.monotonic()
        if now >= self._keepalive_at:
            # (looked at every half KEEPALIVE: a link is silent at most 1.5 x KEEPALIVE)
            self._keepalive_at = now + KEEPALIVE / 2
            self._sent_at = {n: t for n, t in self._sent_at.items() if n in self._connections}
            for node, conn in list(self._connections.items()):
                if (conn.state == CONNECTION_STATE.CONNECTED
                        and now - self._sent_at.get(node, -KEEPALIVE) >= KEEPALIVE):
                    self.send(node, KEEPALIVE_MESSAGE)
        if self._server is not None and not self._ready:
            return
        for conn in list(self._unknownConnections):
            if (isinstance(conn, GuardedConnection)
                    and now - conn.accepted_at > AUTH_SECONDS):
                log.info("raft port: closed a connection from %s that did not identify "
                         "itself within %.0fs", conn.peer or "?", AUTH_SECONDS)
                conn.disconnect()
                self._unknownConnections.discard(conn)
