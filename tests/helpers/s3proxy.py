"""A counting (and fault-injecting) HTTP proxy in front of SeaweedFS's S3 port.

Daemons under test use the proxy's endpoint, so a test can tell exactly how many object
GETs and bytes a scenario cost. Requests are forwarded unchanged (the Host header too, so
SigV4 signatures still verify). `fail_next` makes the next requests answer 503, to prove
retries without touching the server; `refuse` makes every write of one key answer 403,
as S3 does for a key a bucket policy or object lock refuses for good; `stall_next` holds
the next requests of a kind for a while, and `short_next` cuts their bodies in half (with a
matching Content-Length: a response that ends early and does not parse).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect",
        "proxy-connection", "te", "trailer", "upgrade"}


class CountingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # "GET_OBJECT", "LIST", "HEAD", "PUT", ...
        self.get_object_bytes = 0
        self._fail = 0
        self._refused: set[str] = set()  # object keys whose writes answer 403
        self._stall: dict[str, tuple[int, float]] = {}  # kind -> (requests left, seconds)
        self._short: dict[str, int] = {}  # kind -> responses left to cut short
        self._local = threading.local()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        class Server(ThreadingHTTPServer):
            # socketserver's default backlog is 5: a daemon opening its S3 connections at
            # once (the metadata prefetch's batch of HEADs, 64 pooled connections) had
            # SYNs dropped, each retried after 1, 3, 7 s: one stat of an `ls -l` waited
            # 10-13 s, and a 300-file `ls -l` took 15 s through the proxy, 0.2-1 s direct.
            request_queue_size = 1024

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hung up (a daemon killed mid-request) is no news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> CountingProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.get_object_bytes = 0

    def refuse(self, key: str) -> None:
        with self.lock:
            self._refused.add(key)

    def stall_next(self, kind: str, n: int, seconds: float) -> None:
        with self.lock:
            self._stall[kind] = (n, seconds)

    def short_next(self, kind: str, n: int) -> None:
        with self.lock:
            self._short[kind] = n

    def fail_next(self, n: int) -> None:
        with self.lock:
            self._fail = n

    # -- forwarding ---------------------------------------------------------------------

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
            self._local.conn = conn
        return conn

    @staticmethod
    def _kind(method: str, path: str) -> str:
        parts = urlsplit(path)
        is_object = parts.path.strip("/").count("/") >= 1
        if method == "GET":
            return "GET_OBJECT" if is_object else "LIST"
        return method

    def _forward(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        kind = self._kind(h.command, h.path)
        obj = urlsplit(h.path).path.lstrip("/").partition("/")[2]
        with self.lock:
            self.requests[kind] += 1
            fail = self._fail > 0
            if fail:
                self._fail -= 1
            refused = h.command in ("PUT", "POST") and unquote(obj) in self._refused
            left, stall = self._stall.get(kind, (0, 0.0))
            if left:
                self._stall[kind] = (left - 1, stall)
            short = self._short.get(kind, 0) > 0
            if short:
                self._short[kind] -= 1
        if left:
            time.sleep(stall)
        if refused:
            self._error(h, 403, "AccessDenied")
            return
        if fail:
            self._error(h, 503, "SlowDown")
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(h.command, h.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if short:
            data = data[:len(data) // 2]
        h.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                h.send_header(k, v)
        if h.command == "HEAD":
            h.send_header("Content-Length", resp.getheader("Content-Length", "0"))
        else:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
        if kind == "GET_OBJECT" and resp.status in (200, 206):
            with self.lock:
                self.get_object_bytes += len(data)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        msg = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        h.send_response(status)
        h.send_header("Content-Length", str(len(msg)))
        h.end_headers()
        h.wfile.write(msg)

    @staticmethod
    def _read_body(h: BaseHTTPRequestHandler) -> bytes | None:
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        length = int(h.headers.get("Content-Length", "0") or 0)
        return h.rfile.read(length) if length else None
