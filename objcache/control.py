"""The control channel: how `objcache flush/status/umount` talk to a running daemon.

Every directory of a mount has a hidden file named CTRL_NAME (it is not listed). A client
opens it, writes one JSON request terminated by a newline, and reads the JSON reply. This
works wherever the mount is visible, including through a bind mount in a container, with
no socket path to agree on. The request runs inside the write() call, so a `flush` returns
only when its uploads are done.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from objcache import CTRL_NAME
from objcache.errors import Invalid, UserError

log = logging.getLogger(__name__)

_FH_BASE = 1 << 48  # control handles live far above the filesystem's handle numbers
MAX_REQUEST = 1 << 20

Handler = Callable[[dict[str, Any], int], Awaitable[dict[str, Any]]]


class ControlChannel:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._open: dict[int, tuple[int, bytearray, bytes]] = {}
        self._next = _FH_BASE

    def owns(self, fh: int) -> bool:
        return fh >= _FH_BASE

    def open(self, uid: int) -> int:
        fh = self._next
        self._next += 1
        self._open[fh] = (uid, bytearray(), b"")
        return fh

    async def write(self, fh: int, buf: bytes) -> int:
        uid, pending, _ = self._open[fh]
        pending += buf
        if len(pending) > MAX_REQUEST:
            raise Invalid("control request too large")
        if not pending.endswith(b"\n"):
            return len(buf)
        try:
            request = json.loads(pending)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as e:
            reply: dict[str, Any] = {"ok": False, "error": f"malformed request: {e}"}
        else:
            try:
                reply = await self.handler(request, uid)
            except UserError as e:
                reply = {"ok": False, "error": str(e)}
            except Exception as e:
                log.exception("control request %r failed", request.get("op"))
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self._open[fh] = (uid, bytearray(), json.dumps(reply).encode() + b"\n")
        return len(buf)

    def read(self, fh: int, off: int, size: int) -> bytes:
        # The file offset already counts the request bytes written: read from our own
        # cursor instead, which starts at the reply's beginning.
        uid, pending, reply = self._open[fh]
        self._open[fh] = (uid, pending, reply[size:])
        return reply[:size]

    def release(self, fh: int) -> None:
        self._open.pop(fh, None)


def request(path: str, req: dict[str, Any]) -> dict[str, Any]:
    """Send `req` to the daemon serving `path` (a directory or file in a mount)."""
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    ctl = os.path.join(directory, CTRL_NAME)
    try:
        fd = os.open(ctl, os.O_RDWR)
    except FileNotFoundError:
        raise UserError(f"{path} is not inside an objcache mount") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UserError(f"the objcache daemon of {path} is gone (transport endpoint is "
                            "not connected); run: fusermount3 -uz MOUNTPOINT") from None
        raise UserError(f"cannot reach the objcache daemon of {path}: {e.strerror}") from None
    try:
        os.write(fd, json.dumps(req).encode() + b"\n")
        out = bytearray()
        while True:
            piece = os.read(fd, 1 << 20)
            if not piece:
                break
            out += piece
    finally:
        os.close(fd)
    reply: dict[str, Any] = json.loads(out)
    if not reply.get("ok"):
        raise UserError(str(reply.get("error", "the daemon refused the request")))
    return reply
