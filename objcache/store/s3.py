"""S3 object store on boto3: every blocking call runs in a worker thread behind a named
CapacityLimiter, transient failures are retried with backoff, and errors become domain
exceptions (objcache.errors). Credentials come from boto3's standard chain and are never
logged or put in messages.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar
from xml.etree import ElementTree

import boto3
import botocore.exceptions as bex
import trio
import urllib3
from botocore.config import Config
from botocore.parsers import ResponseParserError
from s3transfer.utils import ReadFileChunk

from objcache.errors import (
    NotFound,
    StaleObject,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    UserError,
    first_error,
)
from objcache.metrics import S3_SECONDS
from objcache.store import Fence, ListPage, ObjectInfo, get_small_each, head_each
from objcache.store.parts import part_ranges
from objcache.store.signed import SignedHttp

log = logging.getLogger(__name__)
T = TypeVar("T")

_READ_PIECE = 1 << 20
_TRANSIENT_CODES = {
    "500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
    "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "RequestLimitExceeded", "TooManyRequests", "429",
}
_TRANSIENT_EXC = (
    bex.EndpointConnectionError, bex.ConnectionClosedError, bex.ReadTimeoutError,
    bex.ConnectTimeoutError, bex.ResponseStreamingError, bex.IncompleteReadError,
    ConnectionError, TimeoutError,
    urllib3.exceptions.HTTPError,  # a body read failing on objcache.store.signed's path
    # A response that does not parse (a LIST cut short by a proxy or a dropped
    # connection) is a failed attempt like any other: try again.
    ResponseParserError, ElementTree.ParseError,
)


async def _timed(op: str, attempt: Callable[[], Awaitable[T]]) -> T:
    t0 = time.perf_counter()
    try:
        return await attempt()
    finally:
        S3_SECONDS.labels(op).observe(time.perf_counter() - t0)


def attempt_timeout(retry_seconds: float) -> float:
    """Seconds one S3 attempt may wait for the server (each socket read; connects take 5 s
    at most): short enough that a stalled server leaves room for several attempts within
    the retry budget, long enough for a slow but working one."""
    return max(5.0, min(30.0, retry_seconds / 4))


class S3Stats:
    """Request, error, retry and byte counters by operation (read by `status`)."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": dict(self.requests), "errors": dict(self.errors),
                "retries": dict(self.retries), "bytes_downloaded": self.bytes_in,
                "bytes_uploaded": self.bytes_out}


def _code(e: bex.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: bex.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _missing(e: bex.ClientError) -> bool:
    """S3's answer for no such key (or bucket: the caller tells them apart)."""
    return _code(e) in ("NoSuchKey", "NotFound", "404") or _status(e) == 404


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, bex.ClientError):
        return _code(e) in _TRANSIENT_CODES or _status(e) >= 500 or _status(e) == 429
    return isinstance(e, _TRANSIENT_EXC)


def make_client(endpoint_url: str | None, region: str | None, pool: int,
                connect_timeout: float = 5, read_timeout: float = 30,
                attempts: int = 3, session: Any = None, sign_payload: bool = False) -> Any:
    """A boto3 S3 client. Unless `sign_payload`, an upload's body is sent as
    UNSIGNED-PAYLOAD, with botocore's CRC32 checksum header (which the signature covers):
    over https that is botocore's own default; over http botocore would otherwise hash
    every body with SHA-256 first, a pass that cost half of the daemon's CPU per uploaded
    GiB (2.5 against 1.25 s on this machine) and made the S3 server hash it again."""
    s3cfg: dict[str, Any] = {} if sign_payload else {"payload_signing_enabled": False}
    if endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get(
            "AWS_ENDPOINT_URL_S3"):
        # S3-compatible servers (MinIO, SeaweedFS, COS with custom domains) want path style.
        s3cfg["addressing_style"] = "path"
    cfg = Config(max_pool_connections=pool, connect_timeout=connect_timeout,
                 read_timeout=read_timeout, retries={"mode": "standard",
                                                     "max_attempts": attempts},
                 s3=s3cfg, region_name=region or os.environ.get("AWS_REGION")
                 or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    session = session or boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, config=cfg)


class _PartBody(ReadFileChunk):
    """Exactly `length` bytes of a file from `start`, read as they are sent: what the file
    holds, and zeros past its end (a sparse tail, or a file truncated while the part is
    being sent). A body shorter than its Content-Length leaves S3 waiting for bytes that
    never come: a truncate during a streaming upload held the part, and the flush that
    waited on it, for the 30 s read timeout before its retry."""

    def read(self, amount: int | None = None) -> bytes:
        left = max(self._size - self._amount_read, 0)
        n = left if amount is None or amount < 0 else min(left, amount)
        data = self._fileobj.read(n)
        self._amount_read += n
        return data + bytes(n - len(data))


def part_body(path: str, start: int, length: int) -> ReadFileChunk:
    """The body of a part: streamed from the file (8 parts of 16 MiB in flight would
    otherwise be 128 MiB of daemon memory), always `length` bytes long (_PartBody)."""
    f = open(path, "rb")  # noqa: SIM115 (closed with the body)
    f.seek(start)
    return _PartBody(f, length, start + length, enable_callbacks=False)


def _meta_args(metadata: dict[str, str] | None) -> dict[str, Any]:
    return {"Metadata": metadata} if metadata else {}


BACKGROUND_NICE = 10


_renice = [True]  # cleared when a thread cannot get its priority back (no CAP_SYS_NICE)


def _in_the_background(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn` run by its worker thread at nice BACKGROUND_NICE, then at its own priority
    again (the thread serves others after: readers' downloads among them)."""

    def run() -> T:
        if not _renice[0]:
            return fn()
        tid = threading.get_native_id()
        try:
            old = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(old, BACKGROUND_NICE))
        except OSError:
            return fn()
        try:
            return fn()
        finally:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, old)
            except OSError as e:
                _renice[0] = False  # one nice thread; uploads run at normal priority now
                log.info("uploads run at normal priority (%s)", e.strerror)

    return run


class S3Store:
    """`ObjectStore` over one bucket and prefix."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None,
                 region: str | None = None, concurrency: int = 8,
                 retry_seconds: float = 60.0, fast_requests: bool = True,
                 sign_payload: bool = False) -> None:
        self.bucket = bucket
        self.base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.retry_seconds = retry_seconds
        self.stats = S3Stats()
        # Separate limiters so a burst of chunk downloads cannot starve metadata requests
        # (a lookup waiting behind 8 x 16 MiB GETs would stall every `ls`).
        self.get_limiter = trio.CapacityLimiter(concurrency)
        self.put_limiter = trio.CapacityLimiter(concurrency)
        # Metadata requests are small and latency-bound (a cold `ls -l` is one HEAD per
        # file): more of them in flight than big GETs (measured: 5,000 HEADs 623/s with
        # 8 threads, 786/s with 16).
        self.meta_limiter = trio.CapacityLimiter(max(16, concurrency))
        session = boto3.session.Session()
        # One attempt per call: our loop (_call) retries, with backoff, within the budget
        # (botocore's own retries would spend it on one stalled request).
        timeout = attempt_timeout(retry_seconds)
        self.client = make_client(endpoint_url, region, pool=3 * concurrency + 8,
                                  read_timeout=timeout, attempts=1, session=session,
                                  sign_payload=sign_payload)
        self.endpoint = self.client.meta.endpoint_url
        # HEAD and GET (the requests a cold `ls -l` or small-file pass is made of) skip
        # boto3's per-call machinery; see objcache/store/signed.py.
        self.fast: SignedHttp | None = None
        if fast_requests and SignedHttp.usable(self.client, bucket):
            self.fast = SignedHttp(self.client, session.get_credentials(), bucket,
                                   pool=3 * concurrency + 8, read_timeout=timeout)

    def close(self) -> None:
        """Stop the request engine's thread (idempotent)."""
        if self.fast is not None:
            self.fast.close()

    # -- plumbing -------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.base + key

    async def _call(self, op: str, key: str, fn: Callable[[], T],
                    limiter: trio.CapacityLimiter) -> T:
        """Run `fn` in a thread; retry transient failures with jittered backoff. Uploads
        (write-back: nobody waits on them but a flush) run at a lower CPU priority, so
        that on a busy node the application writing the next checkpoint comes first."""
        if limiter is self.put_limiter:
            fn = _in_the_background(fn)
        return await self._retry(op, key,
                                 lambda: trio.to_thread.run_sync(fn, limiter=limiter))

    async def _retry(self, op: str, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Await `attempt()` until it succeeds, a failure is permanent, or the retry
        budget is spent; transient failures are retried with jittered backoff."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.1
        while True:
            self.stats.requests[op] += 1
            try:
                return await _timed(op, attempt)
            except bex.ClientError as e:
                code, status = _code(e), _status(e)
                if _missing(e):
                    if code == "NoSuchBucket":
                        self.stats.errors[op] += 1
                        raise StoreError(f"bucket {self.bucket!r} does not exist") from None
                    raise NotFound(key) from None
                if code == "PreconditionFailed" or status == 412:
                    raise StaleObject(key) from None
                if not _is_transient(e):
                    self.stats.errors[op] += 1
                    log.error("S3 %s of %r failed: %s (%s)", op, key, code or status, e)
                    raise StoreRefused(f"S3 {op} of {key!r} failed: {code or status}") from None
                err: BaseException = e
            except _TRANSIENT_EXC as e:
                err = e
            except bex.NoCredentialsError:
                self.stats.errors[op] += 1
                raise StoreError("no S3 credentials found") from None
            self.stats.errors[op] += 1
            if time.monotonic() + delay > deadline:
                log.error("S3 %s of %r failed after retrying for %.0fs: %s", op, key,
                          self.retry_seconds, err)
                raise StoreUnavailable(f"S3 {op} of {key!r}: {err}") from None
            self.stats.retries[op] += 1
            log.info("S3 %s of %r failed (%s); retrying in %.2fs", op, key, err, delay)
            await trio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    @staticmethod
    def _info(key: str, size: int, etag: str, mtime: Any,
              metadata: dict[str, str] | None) -> ObjectInfo:
        return ObjectInfo(key=key, size=int(size), etag=etag,
                          mtime_ns=int(mtime.timestamp() * 1e9), metadata=metadata)

    # -- startup check --------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Fail fast (seconds, not minutes) with one line naming the cause. Blocking."""
        quick = make_client(self.client.meta.endpoint_url, self.client.meta.region_name, 2,
                            connect_timeout=3, read_timeout=5, attempts=2)
        where = f"at {self.endpoint}"
        try:
            quick.head_bucket(Bucket=self.bucket)
            quick.list_objects_v2(Bucket=self.bucket, Prefix=self.base, MaxKeys=1)
        except bex.NoCredentialsError:
            raise UserError("no S3 credentials found: set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE") from None
        except bex.ClientError as e:
            code, status = _code(e), _status(e)
            if status == 404 or code in ("NoSuchBucket", "404", "NotFound"):
                raise UserError(f"bucket {self.bucket!r} does not exist {where}") from None
            if status in (401, 403) or code in ("AccessDenied", "403", "InvalidAccessKeyId",
                                                "SignatureDoesNotMatch", "Forbidden"):
                raise UserError(f"access to bucket {self.bucket!r} {where} was denied: check "
                                "the S3 credentials") from None
            raise UserError(f"bucket {self.bucket!r} {where}: S3 error {code or status}") \
                from None
        except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
                bex.ConnectionClosedError, ConnectionError):
            raise UserError(f"cannot reach the S3 endpoint {self.endpoint}") from None
        except ValueError as e:  # e.g. an invalid endpoint URL
            raise UserError(f"invalid S3 endpoint {self.endpoint!r}: {e}") from None

    # -- ObjectStore ----------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo | None:
        fast = self.fast
        full = self._full(key)

        async def through_engine() -> Any:
            assert fast is not None
            return await fast.head_async(full)

        def fn() -> Any:
            return self.client.head_object(Bucket=self.bucket, Key=full)
        try:
            r = await (self._retry("head", key, through_engine) if fast is not None
                       else self._call("head", key, fn, self.meta_limiter))
        except NotFound:
            return None
        return self._info(key, r["ContentLength"], r["ETag"], r["LastModified"],
                          dict(r.get("Metadata") or {}))

    async def get_small_many(
            self, items: Sequence[tuple[str, int]],
            each: Callable[[str, tuple[ObjectInfo, bytes] | None | Exception], None]) -> None:
        """One engine batch of `head_by_get`s (a directory whose small files are being
        read lands here). Without the engine, `head_by_get` per key."""
        fast = self.fast
        if fast is None:
            await get_small_each(self, items, each)
            return
        items = list(items)
        self.stats.requests["get"] += len(items)
        t0 = time.perf_counter()
        seconds = S3_SECONDS.labels("get")

        def answered(i: int, r: tuple[bytes, dict[str, Any]] | BaseException) -> None:
            key, length = items[i]
            seconds.observe(time.perf_counter() - t0)
            if not isinstance(r, BaseException):
                body, d = r
                want = min(length, d["ContentLength"])
                if len(body) >= want:
                    self.stats.bytes_in += want
                    each(key, (self._info(key, d["ContentLength"], d["ETag"],
                                          d["LastModified"], dict(d.get("Metadata") or {})),
                               body[:want]))
                    return
                r = ConnectionError(f"{len(body)} of {want} bytes")
            self._batch_failure("get", key, r, each)

        await fast.get_first_many([(self._full(k), n) for k, n in items], answered)

    def _batch_failure(self, op: str, key: str, e: BaseException,
                       each: Callable[[str, Any], None]) -> None:
        """A failed answer of a batch, as `head_many` hands it over: None for a missing
        object, else a StoreUnavailable naming the cause (the caller asks again if it
        must know)."""
        if isinstance(e, bex.ClientError) and _missing(e):
            each(key, None)
            return
        self.stats.errors[op] += 1
        each(key, StoreUnavailable(f"S3 {op} of {key!r}: {e}"))

    async def head_many(self, keys: Sequence[str],
                        each: Callable[[str, ObjectInfo | None | Exception], None]) -> None:
        """One engine batch (the sweep prefetch of a cold `ls -l` lands here): no task,
        retry loop or thread hop per key. Without the engine, `head` per key."""
        fast = self.fast
        if fast is None:
            await head_each(self, keys, each)
            return
        keys = list(keys)
        self.stats.requests["head"] += len(keys)
        t0 = time.perf_counter()
        seconds = S3_SECONDS.labels("head")

        def answered(i: int, r: dict[str, Any] | BaseException) -> None:
            key = keys[i]
            seconds.observe(time.perf_counter() - t0)
            if isinstance(r, BaseException):
                self._batch_failure("head", key, r, each)
                return
            each(key, self._info(key, r["ContentLength"], r["ETag"], r["LastModified"],
                                 dict(r.get("Metadata") or {})))

        await fast.head_many([self._full(k) for k in keys], answered)

    async def head_by_get(self, key: str, length: int, fd: int) -> tuple[ObjectInfo, int] | None:
        """A HEAD answered by a GET of the first `length` bytes, which land in `fd` at 0:
        one request where a stat and a read of a small file would take two. Returns what
        a HEAD says and how many bytes were written; None if there is no such object."""
        fast = self.fast
        full = self._full(key)

        async def through_engine() -> tuple[dict[str, Any], int]:
            assert fast is not None
            body, r = await fast.get_first_async(full, length)
            want = min(length, r["ContentLength"])
            if len(body) < want:
                raise bex.IncompleteReadError(actual_bytes=len(body), expected_bytes=want)
            # At most SMALL_OBJECT bytes, into the page cache: not worth a thread hop.
            os.pwrite(fd, memoryview(body)[:want], 0)
            self.stats.bytes_in += want
            return r, want

        def fn() -> tuple[dict[str, Any], int]:
            r = self.client.get_object(Bucket=self.bucket, Key=full,
                                       Range=f"bytes=0-{length - 1}")
            body = r["Body"]
            if r.get("ContentRange"):
                r["ContentLength"] = int(r["ContentRange"].rpartition("/")[2])
            want = min(length, r["ContentLength"])
            self._body_into(body, want, fd, 0)
            return r, want

        try:
            r, got = await (self._retry("get", key, through_engine) if fast is not None
                            else self._call("get", key, fn, self.get_limiter))
        except NotFound:
            return None
        return self._info(key, r["ContentLength"], r["ETag"], r["LastModified"],
                          dict(r.get("Metadata") or {})), got

    async def list_dir(self, prefix: str) -> AsyncIterator[ListPage]:
        full = self._full(prefix)
        token: str | None = None
        n = len(self.base)
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full, "Delimiter": "/"}
            if token:
                args["ContinuationToken"] = token
            r = await self._list_page(prefix, args)
            yield ListPage(
                objects=[self._info(o["Key"][n:], o["Size"], o["ETag"], o["LastModified"],
                                    None) for o in r.get("Contents", ())],
                prefixes=[p["Prefix"][n:] for p in r.get("CommonPrefixes", ())])
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return

    async def list_recursive(self, prefix: str, start_after: str = ""
                             ) -> AsyncIterator[ObjectInfo]:
        full = self._full(prefix)
        token: str | None = None
        n = len(self.base)
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                args["ContinuationToken"] = token
            elif start_after:
                args["StartAfter"] = self._full(start_after)
            r = await self._list_page(prefix, args)
            for o in r.get("Contents", ()):
                yield self._info(o["Key"][n:], o["Size"], o["ETag"], o["LastModified"], None)
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return

    async def has_prefix(self, prefix: str) -> bool:
        r = await self._list_page(prefix, {"Bucket": self.bucket, "Prefix": self._full(prefix),
                                           "MaxKeys": 1})
        return bool(r.get("KeyCount") or r.get("Contents"))

    async def _list_page(self, prefix: str, args: dict[str, Any]) -> Any:
        """One ListObjectsV2 page (boto3's arguments and answer shape)."""
        fast = self.fast

        def fn() -> Any:
            if fast is not None:
                return fast.list(args["Prefix"], args.get("Delimiter"),
                                 args.get("ContinuationToken"), args.get("StartAfter"),
                                 args.get("MaxKeys"))
            return self.client.list_objects_v2(**args)
        return await self._call("list", prefix, fn, self.meta_limiter)

    def _get_args(self, key: str, etag: str | None, start: int, length: int) -> dict[str, Any]:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key),
                                "Range": f"bytes={start}-{start + length - 1}"}
        if etag:
            args["IfMatch"] = etag
        return args

    async def get_into(self, key: str, etag: str | None, start: int, buf: memoryview,
                       progress: Callable[[int], None] | None = None) -> None:
        """Bytes [start, start+len(buf)) of the object into `buf` as they arrive;
        `progress(n)` (called in a worker thread) says how many are in. A retried attempt
        starts over at the front of `buf` (the same bytes: the ETag is pinned)."""
        length = len(buf)
        if length <= 0:
            return
        args = self._get_args(key, etag, start, length)
        fast = self.fast

        def fn() -> None:
            if fast is not None:
                done = fast.get_into(args["Key"], start, buf, etag, progress)
            else:
                body = self.client.get_object(**args)["Body"]
                done = 0
                try:
                    while done < length:
                        piece = body.read(min(_READ_PIECE, length - done))
                        if not piece:
                            break
                        buf[done:done + len(piece)] = piece
                        done += len(piece)
                        if progress is not None:
                            progress(done)
                finally:
                    body.close()
            self.stats.bytes_in += done
            if done != length:
                # A short body is a dropped connection: let the retry loop fetch it again.
                raise bex.IncompleteReadError(actual_bytes=done, expected_bytes=length)

        await self._call("get", key, fn, self.get_limiter)

    def _body_into(self, body: Any, length: int, fd: int, file_offset: int) -> None:
        """Copy boto3's GET body into `fd`, then close it; in a worker thread."""
        done = 0
        try:
            while done < length:
                piece = body.read(min(_READ_PIECE, length - done))
                if not piece:
                    break
                os.pwrite(fd, piece, file_offset + done)
                done += len(piece)
        finally:
            body.close()
        self.stats.bytes_in += done
        if done != length:
            # A short body is a dropped connection: let the retry loop fetch it again.
            raise bex.IncompleteReadError(actual_bytes=done, expected_bytes=length)

    async def get_range(self, key: str, etag: str | None, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        args = self._get_args(key, etag, start, length)
        fast = self.fast

        def fn() -> bytes:
            if fast is not None:
                r = fast.get(args["Key"], start, length, etag)
                data: bytes = b""
                try:
                    data = r.read()
                finally:
                    fast.done(r, len(data) == length)
            else:
                data = self.client.get_object(**args)["Body"].read()
            if len(data) != length:
                raise bex.IncompleteReadError(actual_bytes=len(data), expected_bytes=length)
            self.stats.bytes_in += len(data)
            return data

        return await self._call("get", key, fn, self.get_limiter)

    async def put_bytes(self, key: str, body: bytes, metadata: dict[str, str]) -> str:
        def fn() -> str:
            r = self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=body,
                                       **_meta_args(metadata))
            self.stats.bytes_out += len(body)
            return str(r["ETag"])
        return await self._call("put", key, fn, self.put_limiter)

    async def put_file(self, key: str, path: str, size: int, metadata: dict[str, str],
                       part_size: int, fence: Fence | None = None) -> str:
        if size <= part_size:
            def read() -> bytes:
                with open(path, "rb") as f:
                    data = f.read(size)
                if len(data) < size:  # a sparse tail past EOF reads as zeros
                    data += bytes(size - len(data))
                return data
            body = await trio.to_thread.run_sync(read)
            if fence is not None:
                await fence()
            return await self.put_bytes(key, body, metadata)
        return await self._multipart(key, path, size, metadata, part_size, fence)

    async def _multipart(self, key: str, path: str, size: int, metadata: dict[str, str],
                         part_size: int, fence: Fence | None) -> str:
        upload_id = await self.start_upload(key, metadata)
        try:
            etags: dict[int, str] = {}

            async def part(n: int, start: int, length: int) -> None:
                etags[n] = await self.put_part(key, upload_id, n, path, start, length)

            with first_error():
                async with trio.open_nursery() as nursery:
                    for n, start, length in part_ranges(part_size, size):
                        nursery.start_soon(part, n, start, length)
            if fence is not None:
                await fence()
            return await self.finish_upload(key, upload_id, etags)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.abort_upload(key, upload_id)
            raise

    # -- multipart uploads, part by part (streaming write-back drives these) ----------------

    async def start_upload(self, key: str, metadata: dict[str, str]) -> str:
        full = self._full(key)
        r = await self._call("create_multipart", key, lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=full, **_meta_args(metadata)), self.meta_limiter)
        return str(r["UploadId"])

    async def put_part(self, key: str, upload_id: str, number: int, path: str, start: int,
                       length: int) -> str:
        full = self._full(key)

        def fn() -> str:
            with part_body(path, start, length) as body:
                rr = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                             PartNumber=number, Body=body,
                                             ContentLength=length)
            self.stats.bytes_out += length
            return str(rr["ETag"])
        return await self._call("upload_part", key, fn, self.put_limiter)

    async def finish_upload(self, key: str, upload_id: str, etags: dict[int, str]) -> str:
        full = self._full(key)
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        r = await self._call("complete_multipart", key,
                             lambda: self.client.complete_multipart_upload(
                                 Bucket=self.bucket, Key=full, UploadId=upload_id,
                                 MultipartUpload={"Parts": parts}), self.meta_limiter)
        return str(r["ETag"])

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """Best effort, once: a failed abort leaves parts that a bucket lifecycle rule
        (AbortIncompleteMultipartUpload) removes."""
        try:
            await trio.to_thread.run_sync(lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._full(key), UploadId=upload_id))
        except Exception as e:
            log.info("abort of multipart upload for %r failed: %s", key, e)

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   src_etag: str | None = None) -> str:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(dst),
                                "CopySource": {"Bucket": self.bucket, "Key": self._full(src)}}
        if src_etag is not None:
            args["CopySourceIfMatch"] = src_etag
        if metadata is not None:
            args["MetadataDirective"] = "REPLACE"
            args["Metadata"] = metadata

        def fn() -> str:
            r = self.client.copy_object(**args)
            return str(r["CopyObjectResult"]["ETag"])
        return await self._call("copy", src, fn, self.meta_limiter)

    async def delete(self, key: str) -> None:
        await self._call("delete", key, lambda: self.client.delete_object(
            Bucket=self.bucket, Key=self._full(key)), self.meta_limiter)
