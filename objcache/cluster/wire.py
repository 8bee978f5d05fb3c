"""The peer wire format: length-prefixed frames over a TCP stream, and the handshake.

A frame is a 5-byte header (kind: 1 byte, length: 4 bytes big-endian) and a body. A
MSG frame's body is one msgpack map; a DATA frame's body is raw bytes (chunk data), sent
and received without re-encoding: it is received straight into a preallocated buffer.
Every length is checked against a limit before anything is allocated, so a hostile or
broken peer cannot make us buffer more than a chunk.

Handshake (mutual challenge-response with the cluster secret; the secret never crosses
the wire):

    server -> client  {hello: "objcache", v: 1, nonce: Ns}
    client -> server  {node: ID, nonce: Nc, mac: HMAC(K, "C" | Ns | Nc | ID)}
    server -> client  {mac: HMAC(K, "S" | Nc | Ns)}     (or {error: ...} and close)

Frames are not encrypted: the cluster network is trusted for confidentiality (as with
NFS or objcache-go); the handshake keeps strangers from reading or injecting chunks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import trio

from objcache.errors import AuthError, PeerError, ProtocolError

PROTOCOL = "objcache"
VERSION = 1
KIND_MSG = 1
KIND_DATA = 2
HEADER = struct.Struct(">BI")
MAX_HANDSHAKE_MSG = 1024  # before authentication nothing bigger is accepted
# member lists, status, a learner's Raft commands (one command may be 16 MiB: a directory
# rename); chunk bytes and Raft log entries travel in DATA frames
MAX_MSG = 24 << 20
NONCE_BYTES = 32
RECV_SIZE = 256 << 10
ONE_SEND = 64 << 10  # a DATA frame up to this size goes out with its MSG frame, copied


class FrameStream:
    """Frames over one trio stream. Not safe for concurrent use: one request at a time."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        try:
            host, port = stream.socket.getpeername()[:2]
            self.remote = f"{host}:{port}"
        except OSError:
            self.remote = "?"

    async def aclose(self) -> None:
        await self.stream.aclose()

    # -- sending --------------------------------------------------------------------------

    async def send_msg(self, msg: dict[str, Any], data: bytes | memoryview | None = None
                       ) -> None:
        """One MSG frame, optionally followed by one DATA frame, in as few writes as can be."""
        body = msgpack.packb(msg, use_bin_type=True)
        out = HEADER.pack(KIND_MSG, len(body)) + body
        if data is None:
            await self.stream.send_all(out)
            return
        out += HEADER.pack(KIND_DATA, len(data))
        if len(data) <= ONE_SEND:
            # one segment, not two: a voter sends every entry to each of its learners,
            # and on loopback each send also runs the receiver's TCP path
            await self.stream.send_all(out + data)
            return
        await self.stream.send_all(out)
        await self.stream.send_all(data)

    # -- receiving ------------------------------------------------------------------------

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            got = await self.stream.receive_some(RECV_SIZE)
            if not got:
                raise PeerError(f"{self.remote} closed the connection")
            self._buf += got

    async def _header(self, want: int, limit: int) -> int:
        await self._fill(HEADER.size)
        kind, length = HEADER.unpack_from(self._buf)
        if kind != want:
            raise ProtocolError(f"{self.remote} sent a frame of kind {kind}, expected {want}")
        if length > limit:
            raise ProtocolError(f"{self.remote} sent a {length}-byte frame (limit {limit})")
        del self._buf[:HEADER.size]
        return length

    async def recv_msg(self, limit: int = MAX_MSG) -> dict[str, Any]:
        length = await self._header(KIND_MSG, limit)
        await self._fill(length)
        body = bytes(self._buf[:length])
        del self._buf[:length]
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several types for bad input
            raise ProtocolError(f"{self.remote} sent an undecodable message: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(f"{self.remote} sent a {type(msg).__name__}, expected a map")
        return msg

    async def recv_data(self, length: int, into: memoryview | None = None,
                        progress: Callable[[int], None] | None = None
                        ) -> bytearray | memoryview:
        """A DATA frame of exactly `length` bytes, received in place: into `into` when
        given (the caller's buffer: no copy), calling `progress(n)` as bytes arrive."""
        got = await self._header(KIND_DATA, length)
        if got != length:
            raise ProtocolError(f"{self.remote} sent {got} data bytes, expected {length}")
        if into is not None and len(into) != length:
            raise ValueError("the receiving buffer does not fit the data")
        out: bytearray | memoryview = bytearray(length) if into is None else into
        view = memoryview(out)
        have = min(len(self._buf), length)
        view[:have] = self._buf[:have]
        del self._buf[:have]
        sock = self.stream.socket
        while have < length:
            n = await sock.recv_into(view[have:])
            if not n:
                raise PeerError(f"{self.remote} closed the connection mid-transfer")
            have += n
            if progress is not None:
                progress(have)
        return out


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))  # length-prefixed: no ambiguity between parts
        h.update(p)
    return h.digest()


def _field(msg: dict[str, Any], name: str, kind: type, remote: str) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind):
        raise ProtocolError(f"{remote} sent a handshake without a valid {name!r}")
    return value


async def server_handshake(fs: FrameStream, key: bytes) -> str:
    """Authenticate a connecting peer; returns its node id. The caller bounds the time."""
    ns = os.urandom(NONCE_BYTES)
    await fs.send_msg({"hello": PROTOCOL, "v": VERSION, "nonce": ns})
    msg = await fs.recv_msg(MAX_HANDSHAKE_MSG)
    node = _field(msg, "node", str, fs.remote)
    nc = _field(msg, "nonce", bytes, fs.remote)
    mac = _field(msg, "mac", bytes, fs.remote)
    if len(nc) != NONCE_BYTES or not hmac.compare_digest(
            mac, _mac(key, b"C", ns, nc, node.encode())):
        await fs.send_msg({"error": "authentication failed"})
        raise AuthError(f"{fs.remote} (claiming node {node!r}) failed authentication: "
                        "wrong cluster secret")
    await fs.send_msg({"mac": _mac(key, b"S", nc, ns)})
    return node


async def client_handshake(fs: FrameStream, key: bytes, node: str) -> None:
    msg = await fs.recv_msg(MAX_HANDSHAKE_MSG)
    if msg.get("hello") != PROTOCOL or msg.get("v") != VERSION:
        raise ProtocolError(f"{fs.remote} is not an objcache peer (protocol {VERSION})")
    ns = _field(msg, "nonce", bytes, fs.remote)
    nc = os.urandom(NONCE_BYTES)
    await fs.send_msg({"node": node, "nonce": nc, "mac": _mac(key, b"C", ns, nc,
                                                             node.encode())})
    reply = await fs.recv_msg(MAX_HANDSHAKE_MSG)
    if "error" in reply:
        raise AuthError(f"{fs.remote} rejected our cluster secret")
    mac = _field(reply, "mac", bytes, fs.remote)
    if not hmac.compare_digest(mac, _mac(key, b"S", nc, ns)):
        raise AuthError(f"{fs.remote} does not hold our cluster secret")
