"""The S3 store's retry and error mapping, with boto3's real exception types."""

from __future__ import annotations

import os

import botocore.exceptions as bex
import pytest

from objcache.errors import NotFound, StaleObject, StoreError, StoreUnavailable
from objcache.store.s3 import S3Store


def client_error(code: str, status: int) -> bex.ClientError:
    return bex.ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "HeadObject")


class FlakyClient:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    def head_object(self, **kw):  # type: ignore
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        import datetime
        return {"ContentLength": 3, "ETag": '"e"', "Metadata": {},
                "LastModified": datetime.datetime.now(datetime.UTC)}


def store_with(client: FlakyClient, retry_seconds: float = 5) -> S3Store:
    s = S3Store("b", "p", endpoint_url="http://127.0.0.1:9", retry_seconds=retry_seconds,
                fast_requests=False)
    s.client = client
    return s


async def test_transient_errors_are_retried() -> None:
    fails = [client_error("SlowDown", 503), client_error("InternalError", 500),
             bex.EndpointConnectionError(endpoint_url="x"),
             bex.ReadTimeoutError(endpoint_url="x")]
    c = FlakyClient(fails)
    s = store_with(c)
    info = await s.head("k")
    assert info is not None and info.size == 3
    assert c.calls == 5 and s.stats.retries["head"] == 4


async def test_permanent_errors_are_not_retried() -> None:
    s = store_with(FlakyClient([client_error("AccessDenied", 403)]))
    with pytest.raises(StoreError, match="'k'"):
        await s.head("k")
    assert await store_with(FlakyClient([client_error("404", 404)])).head("k") is None
    with pytest.raises(StaleObject):
        await store_with(FlakyClient([client_error("PreconditionFailed", 412)])).head("k")
    with pytest.raises(NotFound):
        await store_with(FlakyClient([client_error("NoSuchKey", 404)]))._call(
            "get", "k", lambda: (_ for _ in ()).throw(client_error("NoSuchKey", 404)),
            s.meta_limiter)


async def test_retry_budget_ends_in_unavailable() -> None:
    s = store_with(FlakyClient([client_error("503", 503)] * 100), retry_seconds=0.5)
    with pytest.raises(StoreUnavailable):
        await s.head("k")


def test_signed_path_is_used_only_where_it_builds_the_same_requests(monkeypatch) -> None:  # type: ignore
    from objcache.store.s3 import make_client
    from objcache.store.signed import SignedHttp
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(v, raising=False)
    custom = make_client("http://127.0.0.1:9", "us-east-1", 2)  # path style
    aws = make_client(None, "us-east-1", 2)  # virtual-hosted style
    assert SignedHttp.usable(custom, "any.bucket.name")
    assert SignedHttp.usable(aws, "plain-bucket")
    assert not SignedHttp.usable(aws, "dotted.bucket")  # TLS host names break
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    assert not SignedHttp.usable(custom, "any")  # boto3 honours proxies; we would not


class PartClient:
    """Takes an upload_part as a server would, reading the body to its Content-Length,
    after `before_read` (a writer truncating the file while the part is on its way)."""

    def __init__(self, before_read) -> None:  # type: ignore[no-untyped-def]
        self.before_read = before_read
        self.bodies: list[bytes] = []

    def upload_part(self, *, Body, ContentLength, **kw):  # type: ignore[no-untyped-def]
        self.before_read()
        got = Body.read()
        assert len(got) == ContentLength == len(Body), (len(got), ContentLength)
        self.bodies.append(got)
        return {"ETag": '"p"'}


async def test_a_part_of_a_file_truncated_while_it_is_sent_keeps_its_length(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A part's body is always as long as it says: bytes the file no longer has (a
    truncate below the part while it was being sent, a sparse tail) are sent as zeros.
    (A short body left the request waiting for the read timeout, 30 s, on real S3.)"""
    path = tmp_path / "f"
    data = bytes(range(256)) * 8192  # 2 MiB
    path.write_bytes(data)
    c = PartClient(lambda: os.truncate(path, 4096))
    s = store_with(c)  # type: ignore[arg-type]
    assert await s.put_part("k", "u", 1, str(path), 1 << 20, 1 << 20) == '"p"'
    assert c.bodies[0] == bytes(1 << 20)  # all of it past the new end
    path.write_bytes(data)
    assert await s.put_part("k", "u", 1, str(path), 0, 1 << 20) == '"p"'
    assert c.bodies[1] == data[:4096] + bytes((1 << 20) - 4096)
    c.before_read = lambda: None
    assert await s.put_part("k", "u", 2, str(path), 4000, 200) == '"p"'  # a sparse tail
    assert c.bodies[2] == data[4000:4096] + bytes(104)


class _Raw:
    """An empty response body, as urllib3 would hand it to botocore."""

    def stream(self, *args, **kw):  # type: ignore[no-untyped-def]
        return iter(())


def _sent_headers(sign_payload: bool, monkeypatch) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The headers an upload_part to an http endpoint goes out with (caught before it is
    sent, answered with an empty 200)."""
    from botocore.awsrequest import AWSResponse

    from objcache.store.s3 import make_client
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    client = make_client("http://127.0.0.1:9", "us-east-1", 2, sign_payload=sign_payload)
    sent: dict[str, str] = {}

    def catch(request, **kw):  # type: ignore[no-untyped-def]
        sent.update({k.lower(): v.decode() if isinstance(v, bytes) else v
                     for k, v in request.headers.items()})
        return AWSResponse(request.url, 200, {"ETag": '"e"'}, _Raw())

    client.meta.events.register("before-send.s3.UploadPart", catch)
    client.upload_part(Bucket="b", Key="k", UploadId="u", PartNumber=1, Body=b"x" * 1000)
    return sent


def test_uploads_are_not_hashed_unless_asked(monkeypatch) -> None:  # type: ignore
    """Over http botocore hashed every upload's body with SHA-256 before sending it: half
    of the daemon's CPU per uploaded GiB. The CRC32 checksum header stays (signed)."""
    import hashlib
    plain = _sent_headers(False, monkeypatch)
    assert plain["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert "x-amz-checksum-crc32" in plain
    assert "x-amz-checksum-crc32" in plain["authorization"]  # (a signed header)
    signed = _sent_headers(True, monkeypatch)
    assert signed["x-amz-content-sha256"] == hashlib.sha256(b"x" * 1000).hexdigest()
