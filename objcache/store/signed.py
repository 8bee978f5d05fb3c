"""The hot S3 reads (HEAD, GET, LIST) as plain SigV4-signed HTTP: HEAD and small GETs on
libcurl's multi interface (objcache/store/curl.py), ranged chunk GETs and LIST on urllib3.

boto3's per-call machinery (parameter validation, event hooks, response parsing) costs
about 3 ms of CPU per request; a cold `ls -l` or a pass over small files is nothing but
such requests, and in one Python process that CPU is the ceiling (measured with 16
threads against SeaweedFS on 2 vCPUs: HEAD 335/s with boto3, 1,170/s here; GET of 16 KiB
336/s vs 785/s; a LIST page is parsed without botocore's per-entry date parsing). Credentials
come from boto3's chain; signing is `SigV4` below (botocore's rules, with the signing key
kept for the day). Through libcurl a HEAD costs 60-75 µs of CPU instead of about 500 µs
with urllib3 and 16 threads. Everything else (PUT, multipart, COPY, DELETE) stays on boto3.

Failures are raised as the same botocore exceptions boto3 would raise (ClientError with
the S3 error code and HTTP status, or a connection/timeout error), so S3Store's one retry
and error-mapping loop handles both paths.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import botocore.exceptions as bex
import urllib3
from botocore.httpsession import get_cert_path
from botocore.utils import percent_encode

from objcache.store.curl import CurlEngine, Reply, Request

_META = "x-amz-meta-"
_PIECE = 1 << 20  # bytes per readinto (and per progress report) of a GET body
Progress = Callable[[int], None]
A = TypeVar("A")
# Virtual-hosted style needs a DNS label; with dots TLS host names break.
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")


class SignedHttp:
    """HEAD and GET of one bucket's objects. Thread-safe (urllib3 pools are)."""

    def __init__(self, client: Any, credentials: Any, bucket: str, pool: int,
                 connect_timeout: float = 5, read_timeout: float = 30) -> None:
        self._credentials = credentials  # boto3's chain (may refresh itself)
        self._region = client.meta.region_name
        endpoint = client.meta.endpoint_url.rstrip("/")
        if (client.meta.config.s3 or {}).get("addressing_style") == "path":
            self._base = f"{endpoint}/{bucket}/"
        else:
            parts = urlsplit(endpoint)
            self._base = f"{parts.scheme}://{bucket}.{parts.netloc}/"
        self._timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        # the CA bundle boto3 would use (AWS_CA_BUNDLE, else botocore's default)
        ca = os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)
        # HEAD and GET are idempotent: one quiet retry covers a pooled keep-alive
        # connection the server closed meanwhile (S3Store's loop handles the rest)
        retries = urllib3.Retry(total=1, connect=1, read=1, status=0, redirect=0, other=0,
                                allowed_methods={"GET", "HEAD"}, raise_on_status=False)
        self._pool = urllib3.PoolManager(maxsize=pool, block=False, retries=retries,
                                         ca_certs=ca)
        self._signer = SigV4(self._region)
        # HEAD and small GET, the requests that come by the thousand, go through libcurl
        # in one thread instead (objcache/store/curl.py); the rest stays on urllib3.
        # 64 in flight: against SeaweedFS on loopback, 5,600 HEAD/s with 16 and 7,700/s
        # with 64.
        self.engine = CurlEngine(max(pool, 64), connect_timeout, read_timeout,
                                 ca if self._base.startswith("https:") else None)

    def close(self) -> None:
        self.engine.close()
        self._pool.clear()

    @staticmethod
    def usable(client: Any, bucket: str) -> bool:
        """Whether requests can go out without boto3's extras: no proxy, and an address
        style we build the same way (path style, or a plain DNS-label bucket)."""
        if any(os.environ.get(v) for v in _PROXY_ENV):
            return False
        s3 = client.meta.config.s3 or {}
        return s3.get("addressing_style") == "path" or bool(_DNS_BUCKET.match(bucket))

    def _signed(self, method: str, key: str, headers: dict[str, str],
                query: str = "") -> tuple[str, dict[str, str]]:
        url = self._base + percent_encode(key, safe="/~") + (f"?{query}" if query else "")
        creds = self._credentials
        if creds is None:
            raise bex.NoCredentialsError()
        return url, self._signer.sign(method, url, headers, creds.get_frozen_credentials())

    def _request(self, method: str, key: str, headers: dict[str, str],
                 query: str = "") -> Any:
        url, headers = self._signed(method, key, headers, query)
        try:
            return self._pool.request(method, url, headers=headers,
                                      preload_content=False, timeout=self._timeout,
                                      redirect=False)
        except urllib3.exceptions.TimeoutError as e:
            raise TimeoutError(f"S3 {method} timed out: {e}") from None
        except urllib3.exceptions.HTTPError as e:
            raise ConnectionError(f"S3 {method} failed: {e}") from None
        except ValueError as e:  # http.client on a pooled socket that was closed under it
            raise ConnectionError(f"S3 {method} failed: {e}") from None

    def _raise(self, r: Any, op: str) -> None:
        body = r.read()  # error bodies are small
        r.release_conn()
        raise _client_error(r.status, r.reason or "", body, op)

    def _engine_request(self, method: str, key: str, headers: dict[str, str],
                        limit: int) -> Request:
        url, signed = self._signed(method, key, headers)
        return Request(url, [f"{k}: {v}" for k, v in signed.items()], method == "HEAD",
                       limit)

    async def _fetch(self, method: str, key: str, headers: dict[str, str],
                     limit: int) -> Reply:
        return await self.engine.fetch(self._engine_request(method, key, headers, limit))

    async def head_async(self, key: str) -> dict[str, Any]:
        """`head`, through the engine: no thread waits for it."""
        return _head_answer(await self._fetch("HEAD", key, {}, 0))

    async def head_many(self, keys: list[str],
                        each: Callable[[int, dict[str, Any] | BaseException], None]
                        ) -> None:
        """HEAD every key at once; `each(index, answer)` as answers come: what `head`
        returns, or what it would raise."""
        await self._fetch_many([self._engine_request("HEAD", k, {}, 0) for k in keys],
                               _head_answer, each)

    async def get_first_many(
            self, items: list[tuple[str, int]],
            each: Callable[[int, tuple[bytes, dict[str, Any]] | BaseException], None]
            ) -> None:
        """`get_first_async` of every (key, length) at once; `each(index, answer)` as
        answers come: what it returns, or what it would raise."""
        await self._fetch_many(
            [self._engine_request("GET", k, {"Range": f"bytes=0-{n - 1}"}, n)
             for k, n in items], _first_answer, each)

    async def _fetch_many(self, reqs: list[Request], parse: Callable[[Reply], A],
                          each: Callable[[int, A | BaseException], None]) -> None:
        """One engine batch; each reply parsed, or the error its parse raises."""
        def answered(i: int, reply: Reply | BaseException) -> None:
            answer: A | BaseException = reply
            if isinstance(reply, Reply):
                try:
                    answer = parse(reply)
                except bex.ClientError as e:
                    answer = e
            each(i, answer)

        await self.engine.fetch_many(reqs, answered)

    async def get_first_async(self, key: str, length: int) -> tuple[bytes, dict[str, Any]]:
        """The first `length` bytes (fewer if the
        object is smaller; all of them) and what a HEAD would have said."""
        return _first_answer(
            await self._fetch("GET", key, {"Range": f"bytes=0-{length - 1}"}, length))

    def get(self, key: str, start: int, length: int, etag: str | None) -> Any:
        """An open response carrying exactly bytes start..start+length-1. Read it, then
        `done(r, complete)`."""
        headers = {"Range": f"bytes={start}-{start + length - 1}"}
        if etag:
            headers["If-Match"] = etag
        r = self._request("GET", key, headers)
        if r.status not in (200, 206):
            self._raise(r, "GetObject")
        if r.status == 200 and int(r.headers.get("Content-Length", -1)) != length:
            r.close()  # the server ignored the range: this body is not what we asked for
            raise bex.ClientError({"Error": {"Code": "RangeIgnored", "Message": ""},
                                   "ResponseMetadata": {"HTTPStatusCode": 200}}, "GetObject")
        return r

    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None,
                 progress: Progress | None) -> int:
        """Bytes start..start+len(buf)-1 into `buf`, read from the socket straight into
        it (http.client's readinto: no intermediate copy; urllib3's own readinto copies);
        `progress(n)` after each piece with the bytes in so far. Returns how many came."""
        n = len(buf)
        r = self.get(key, start, n, etag)
        fp = r._fp  # the http.client response under urllib3's (raw bytes, no decoding)
        done = 0
        try:
            while done < n:
                k = fp.readinto(buf[done:min(n, done + _PIECE)])
                if not k:
                    break
                done += k
                if progress is not None:
                    progress(done)
        finally:
            self.done(r, done == n)
        return done

    @staticmethod
    def done(r: Any, complete: bool) -> None:
        """Return the connection to the pool only when its body was read to the end; a
        half-read connection would hand the rest to the next request."""
        if complete:
            r.release_conn()
        else:
            r.close()


    def list(self, prefix: str, delimiter: str | None = None, token: str | None = None,
             start_after: str | None = None, max_keys: int | None = None
             ) -> dict[str, Any]:
        """One ListObjectsV2 page, shaped as boto3's answer (Contents with Key, Size, ETag,
        LastModified; CommonPrefixes; IsTruncated; NextContinuationToken; KeyCount).
        Keys come URL-encoded (encoding-type=url: XML cannot carry every byte a key may
        hold) and are decoded here, as boto3 does."""
        q: dict[str, str] = {"list-type": "2", "encoding-type": "url", "prefix": prefix}
        if delimiter:
            q["delimiter"] = delimiter
        if token:
            q["continuation-token"] = token
        if start_after:
            q["start-after"] = start_after
        if max_keys:
            q["max-keys"] = str(max_keys)
        query = "&".join(f"{k}={percent_encode(v, safe='-_.~')}" for k, v in sorted(q.items()))
        r = self._request("GET", "", {}, query)
        if r.status != 200:
            self._raise(r, "ListObjectsV2")
        body = r.read()
        r.release_conn()
        root = ET.fromstring(body)
        ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""

        def text(el: Any, name: str) -> str:
            return el.findtext(ns + name) or ""

        contents = [{"Key": unquote(text(c, "Key")), "Size": int(text(c, "Size") or 0),
                     "ETag": text(c, "ETag"),
                     "LastModified": _iso_date(text(c, "LastModified"))}
                    for c in root.iter(ns + "Contents")]
        prefixes = [{"Prefix": unquote(text(p, "Prefix"))}
                    for p in root.iter(ns + "CommonPrefixes")]
        out: dict[str, Any] = {"Contents": contents, "CommonPrefixes": prefixes,
                               "IsTruncated": text(root, "IsTruncated") == "true",
                               "KeyCount": int(text(root, "KeyCount") or len(contents))}
        nxt = text(root, "NextContinuationToken")
        if nxt:
            out["NextContinuationToken"] = nxt
        return out


_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class SigV4:
    """AWS Signature Version 4 for bodiless requests (HEAD, GET, LIST), as botocore's
    S3SigV4Auth signs them (tests/unit/test_s3_signed.py compares the two), at a fraction
    of its cost: the signing key is derived once per day and secret, not per request, and
    only the headers S3 requires are signed (host, x-amz-date, x-amz-content-sha256 and a
    session token). botocore's per-request work was about a third of a HEAD's CPU."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._keys: dict[tuple[str, str], bytes] = {}  # (secret, day) -> signing key

    def _key(self, secret: str, day: str) -> bytes:
        k = self._keys.get((secret, day))
        if k is None:
            k = ("AWS4" + secret).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            if len(self._keys) > 8:
                self._keys.clear()
            self._keys[(secret, day)] = k
        return k

    def sign(self, method: str, url: str, headers: dict[str, str], creds: Any,
             now: datetime | None = None) -> dict[str, str]:
        """`headers` plus the signature's for a request of `url` (already percent-encoded,
        as it goes on the wire)."""
        netloc, _, rest = url.partition("://")[2].partition("/")
        path, _, query = rest.partition("?")
        stamp = (now.strftime("%Y%m%dT%H%M%SZ") if now is not None
                 else time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        day = stamp[:8]
        if query:
            pairs = sorted(p.partition("=")[::2] for p in query.split("&") if p)
            query = "&".join(f"{k}={v}" for k, v in pairs)
        signed = {"host": netloc, "x-amz-content-sha256": _EMPTY_SHA256,
                  "x-amz-date": stamp}
        if creds.token:
            signed["x-amz-security-token"] = creds.token
        names = ";".join(sorted(signed))
        canonical = "\n".join([method, "/" + path, query,
                               "".join(f"{k}:{signed[k]}\n" for k in sorted(signed)),
                               names, _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        sig = hmac.new(self._key(creds.secret_key, day), to_sign.encode(),
                       hashlib.sha256).hexdigest()
        out = dict(headers)
        out.update((k, v) for k, v in signed.items() if k != "host")
        out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders={names}, Signature={sig}")
        return out


def _head_answer(r: Reply) -> dict[str, Any]:
    if r.status != 200:
        raise _client_error(r.status, r.reason, b"", "HeadObject")
    return _described(_Lower(r.headers), int(r.headers.get("content-length", 0)))


def _first_answer(r: Reply) -> tuple[bytes, dict[str, Any]]:
    if r.status == 206:
        total = int(r.headers.get("content-range", "/0").rpartition("/")[2])
    elif r.status == 200:
        total = int(r.headers.get("content-length", 0))
    else:
        raise _client_error(r.status, r.reason, r.body, "GetObject")
    return r.body, _described(_Lower(r.headers), total)


def _client_error(status: int, reason: str, body: bytes, op: str) -> bex.ClientError:
    """What boto3 raises for this answer: the S3 error code from the body when it has
    one, else the HTTP status."""
    code, message = str(status), reason
    if body:
        try:
            root = ET.fromstring(body)
            code = root.findtext("Code") or code
            message = root.findtext("Message") or message
        except ET.ParseError:
            pass
    return bex.ClientError({"Error": {"Code": code, "Message": message},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class _Lower(dict[str, str]):
    """Headers whose names are lowercase already, read as `_described` reads them."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)


def _iso_date(value: str) -> datetime:
    if not value:
        return datetime.fromtimestamp(0).astimezone()
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _described(h: Any, size: int) -> dict[str, Any]:
    meta = {k[len(_META):].lower(): v for k, v in h.items() if k.lower().startswith(_META)}
    return {"ContentLength": size, "ETag": h.get("ETag", ""),
            "LastModified": _http_date(h.get("Last-Modified")), "Metadata": meta}


_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}


def _http_date(value: str | None) -> datetime:
    if not value:
        return datetime.fromtimestamp(0).astimezone()
    # The IMF-fixdate every S3 server sends ("Tue, 24 Nov 2026 11:04:59 GMT") directly,
    # 1.7 µs against parsedate_to_datetime's 4.2 µs (a cold `ls -l` parses one per entry).
    parts = value.split(" ")
    if len(parts) == 6 and parts[5] == "GMT" and parts[2] in _MONTHS:
        try:
            h, m, sec = parts[4].split(":")
            return datetime(int(parts[3]), _MONTHS[parts[2]], int(parts[1]), int(h), int(m),
                            int(sec), tzinfo=UTC)
        except ValueError:
            pass
    return parsedate_to_datetime(value)
