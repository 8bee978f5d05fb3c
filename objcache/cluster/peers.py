"""Peer connections: the authenticated server loop and the client connection pool.

The server authenticates each connection, then answers one request at a time on it; a
peer that sends garbage, a wrong secret, an oversized frame or nothing at all within the
handshake timeout is logged and dropped, and nothing it did reaches the rest of the
daemon. The client keeps a pool of authenticated connections per peer address and reuses
them; a connection that failed is closed, never returned to the pool.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from objcache.cluster.wire import FrameStream, client_handshake, server_handshake
from objcache.errors import (
    Conflict,
    Exists,
    Invalid,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotEmpty,
    NotFound,
    ObjcacheError,
    PeerError,
    ProtocolError,
    ReadOnly,
    StaleObject,
    error_from_code,
)
from objcache.metrics import PEER_SECONDS

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
IDLE_TIMEOUT = 300.0  # server side: an authenticated connection silent this long is closed
# Client side: a pooled connection idle this long is closed, not reused. Well below the
# peer's IDLE_TIMEOUT: one reused as the peer closes it finds it closed (see `_request`).
POOL_IDLE = 60.0
MAX_CONNECTIONS = 1024
MAX_IDLE_PER_PEER = 16

# A request handler gets (peer node id, message) and returns (reply, optional data).
Reply = tuple[dict[str, Any], bytes | None]
# Given a reply's header, the callback told how many of its data bytes have arrived.
Progress = Callable[[dict[str, Any]], Callable[[int], None]]
Handler = Callable[[str, dict[str, Any]], Awaitable[Reply]]


def field_str(msg: dict[str, Any], name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str):
        raise ProtocolError(f"request field {name!r} is not a string")
    return v


def field_int(msg: dict[str, Any], name: str, lo: int, hi: int) -> int:
    v = msg.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"request field {name!r} is not an integer in [{lo}, {hi}]")
    return v


class Routes:
    """Which handler serves which request op; built once, by whoever composes the node."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers

    async def __call__(self, peer: str, msg: dict[str, Any]) -> Reply:
        op = msg.get("op")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ProtocolError(f"unknown request {op!r:.50} from {peer}")
        return await handler(peer, msg)


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class PeerServer:
    """Serves authenticated peer connections (handed to it by trio.serve_listeners)."""

    def __init__(self, key: bytes, handler: Handler) -> None:
        self.key = key
        self.handler = handler
        self.connections = 0
        self.rejected = 0

    async def serve_one(self, stream: trio.SocketStream) -> None:
        fs = FrameStream(stream)
        if self.connections >= MAX_CONNECTIONS:
            log.warning("refusing peer connection from %s: %d connections open", fs.remote,
                        self.connections)
            await stream.aclose()
            return
        self.connections += 1
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                node = await server_handshake(fs, self.key)
            while await self._answer_one(fs, node):
                pass
        except trio.TooSlowError:
            self.rejected += 1
            log.warning("dropped peer connection from %s: no handshake within %.0fs",
                        fs.remote, HANDSHAKE_TIMEOUT)
        except ProtocolError as e:
            self.rejected += 1
            log.warning("dropped peer connection: %s", e)
        except (PeerError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away
        finally:
            self.connections -= 1
            await stream.aclose()

    async def _answer_one(self, fs: FrameStream, node: str) -> bool:
        """Answer the connection's next request; False once it stayed silent too long.
        Its own frame: the request and the reply (a chunk's bytes, a snapshot) are freed
        once answered, not kept while the connection waits for the next request (up to
        IDLE_TIMEOUT, on every pooled connection of every peer)."""
        with trio.move_on_after(IDLE_TIMEOUT) as idle:
            msg = await fs.recv_msg()
        if idle.cancelled_caught:
            return False
        reply, data = await self._dispatch(node, msg)
        await fs.send_msg(reply, data)
        return True

    async def _dispatch(self, node: str, msg: dict[str, Any]
                        ) -> tuple[dict[str, Any], bytes | None]:
        try:
            return await self.handler(node, msg)
        except ProtocolError:
            raise
        except Exception as e:
            # A failure to serve one request (S3 down, a bug) is that request's error; the
            # connection and the daemon carry on. Domain errors keep their code.
            if not isinstance(e, ObjcacheError) or e.errno == errno.EIO:
                log.warning("peer request %r from %s failed: %s", msg.get("op"), node, e,
                            exc_info=not isinstance(e, ObjcacheError | OSError))
            code = e.code if isinstance(e, ObjcacheError) else "failed"
            return {"error": code, "msg": str(e)}, None


class _Conn:
    __slots__ = ("fs", "idle_since", "reused")

    def __init__(self, fs: FrameStream) -> None:
        self.fs = fs
        self.reused = False
        self.idle_since = 0.0  # (trio time) when it last went back to the pool


class PeerPool:
    """Authenticated, pooled connections to peers, by address."""

    def __init__(self, key: bytes, node_id: str) -> None:
        self.key = key
        self.node_id = node_id
        self._idle: dict[str, list[_Conn]] = {}
        self.requests = 0
        self.failures = 0
        self.by_op: dict[str, int] = {}  # requests sent, by op

    async def _connect(self, addr: str) -> _Conn:
        host, port = split_addr(addr)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise PeerError(f"connecting to peer {addr} timed out") from None
        except OSError as e:
            raise PeerError(f"cannot connect to peer {addr}: "
                            f"{e.strerror or errno.errorcode.get(e.errno or 0, e)}") from None
        fs = FrameStream(stream)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await client_handshake(fs, self.key, self.node_id)
        except BaseException as e:
            await _close(fs)
            if isinstance(e, trio.TooSlowError):
                raise PeerError(f"peer {addr} did not complete the handshake") from None
            if isinstance(e, trio.BrokenResourceError | OSError):
                raise PeerError(f"peer {addr} closed the connection during the handshake") \
                    from None
            raise
        return _Conn(fs)

    async def request(self, addr: str, msg: dict[str, Any], *, timeout: float,
                      max_data: int = 0, into: memoryview | None = None,
                      progress: Progress | None = None
                      ) -> tuple[dict[str, Any], bytearray | memoryview | None]:
        """Send one request and return (reply, data). Data lands in `into` when given
        (exactly that many bytes are then expected); `progress(reply)` gives the callback
        told how many have arrived (it may raise a ProtocolError to refuse them). Raises
        PeerError (AuthError, ProtocolError) when the peer cannot answer, and the reply's
        error when it failed."""
        self.requests += 1
        op = str(msg.get("op"))
        self.by_op[op] = self.by_op.get(op, 0) + 1
        t0 = time.perf_counter()
        try:
            return await self._request(addr, msg, timeout, max_data, into, progress)
        finally:
            PEER_SECONDS.labels(op).observe(time.perf_counter() - t0)

    async def _request(self, addr: str, msg: dict[str, Any], timeout: float, max_data: int,
                       into: memoryview | None, progress: Progress | None
                       ) -> tuple[dict[str, Any], bytearray | memoryview | None]:
        for attempt in range(2):
            # The retry after a pooled connection failed goes on a new one: the others in
            # the pool are as old (two readers' pooled connections to an owner, idle for
            # the peer's IDLE_TIMEOUT, all closed at once: each read tried two of them,
            # failed, suspected the owner and read S3 instead: a chunk fetched twice).
            conn = await self._pooled(addr) if attempt == 0 else None
            if conn is None:
                conn = await self._connect(addr)
            try:
                with trio.fail_after(timeout):
                    await conn.fs.send_msg(msg)
                    reply = await conn.fs.recv_msg()
                    data = None
                    size = reply.get("data")
                    if size is not None:
                        limit = max_data if into is None else len(into)
                        if (not isinstance(size, int) or not 0 <= size <= limit
                                or (into is not None and size != len(into))):
                            raise ProtocolError(f"peer {addr} offered {size!r} data bytes "
                                                f"(limit {limit})")
                        data = await conn.fs.recv_data(
                            size, into, None if progress is None else progress(reply))
            except trio.TooSlowError:
                await _close(conn.fs)
                self.failures += 1
                raise PeerError(f"peer {addr} did not answer {msg.get('op')!r} within "
                                f"{timeout:.1f}s") from None
            except (PeerError, trio.BrokenResourceError, trio.ClosedResourceError,
                    OSError) as e:
                await _close(conn.fs)
                if conn.reused and attempt == 0 and not isinstance(e, ProtocolError):
                    continue  # the peer closed an idle pooled connection: use a fresh one
                self.failures += 1
                if isinstance(e, PeerError):
                    raise
                raise PeerError(f"connection to peer {addr} failed: {e}") from None
            except BaseException:
                # Cancelled mid-request (a caller's deadline): the answer may still come
                # on this connection, so it is closed, not pooled; left to the garbage
                # collector, it stayed open until a collection, and the peer's side of
                # it until the peer's idle timeout.
                await _close(conn.fs)
                raise
            conn.reused = True
            conn.idle_since = trio.current_time()
            pool = self._idle.setdefault(addr, [])
            if len(pool) < MAX_IDLE_PER_PEER:
                pool.append(conn)
            else:
                await _close(conn.fs)
            if "error" in reply:
                raise _remote_error(addr, reply)
            return reply, data
        raise AssertionError("unreachable")

    async def _pooled(self, addr: str) -> _Conn | None:
        """The most recently used pooled connection to `addr` that has not been idle for
        POOL_IDLE (those that have are closed); None if there is none."""
        idle = self._idle.get(addr)
        if not idle:
            return None
        limit = trio.current_time() - POOL_IDLE
        stale = [c for c in idle if c.idle_since < limit]
        if stale:
            idle[:] = [c for c in idle if c.idle_since >= limit]
            for c in stale:
                await _close(c.fs)
        return idle.pop() if idle else None

    async def forget(self, addr: str) -> None:
        """Close the idle connections to a peer that left or died."""
        for conn in self._idle.pop(addr, []):
            await _close(conn.fs)

    async def aclose(self) -> None:
        for addr in list(self._idle):
            await self.forget(addr)


# Errors about what was asked (the caller sees them as if it had asked S3 itself); any other
# failure to serve (S3 down, no room, a bug) is the peer's, and callers fall back.
_ABOUT_THE_REQUEST = (NotFound, StaleObject, Exists, NotEmpty, IsADirectory, NotADirectory,
                      Invalid, NameTooLong, ReadOnly, Conflict)


def _remote_error(addr: str, reply: dict[str, Any]) -> ObjcacheError:
    """The error a peer answered with (it is alive: `answered`)."""
    err = error_from_code(reply.get("error"),
                          f"peer {addr}: {reply.get('msg') or reply.get('error')}")
    if not isinstance(err, _ABOUT_THE_REQUEST):
        err = PeerError(str(err))
    if isinstance(err, PeerError):
        err.answered = True
    return err


async def _close(fs: FrameStream) -> None:
    with trio.move_on_after(1) as scope:
        scope.shield = True
        try:
            await fs.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
