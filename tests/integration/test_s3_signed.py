"""HEAD and ranged GET on objcache's signed-HTTP path (objcache/store/signed.py) against
a real SeaweedFS with enforced credentials: the same answers and the same errors as
boto3's path, for awkward keys too."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from objcache.errors import StaleObject, StoreError
from objcache.store.s3 import S3Store
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY

KEYS = ["plain.bin", "with space/and+plus.bin", "ünïcode/€uro~tilde.bin",
        "percent%41/semi;colon=eq&amp.bin", "dir//double/slash.bin"]


@pytest.fixture
def creds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _stores(seaweed, bucket: str) -> tuple[S3Store, S3Store]:  # type: ignore[no-untyped-def]
    fast = S3Store(bucket, "pre", seaweed.endpoint, retry_seconds=2)
    slow = S3Store(bucket, "pre", seaweed.endpoint, retry_seconds=2, fast_requests=False)
    assert fast.fast is not None and slow.fast is None
    return fast, slow


async def test_same_answers_as_boto3(seaweed, bucket, s3, creds, tmp_path) -> None:  # type: ignore
    fast, slow = _stores(seaweed, bucket)
    bodies = {k: os.urandom(100_000 + i) for i, k in enumerate(KEYS)}
    for k, body in bodies.items():
        s3.put_object(Bucket=bucket, Key=f"pre/{k}", Body=body,
                      Metadata={"mode": "33261", "mtime-ns": "123"})
    for k, body in bodies.items():
        a, b = await fast.head(k), await slow.head(k)
        assert a == b and a is not None and a.size == len(body), (k, a, b)
        assert a.metadata == {"mode": "33261", "mtime-ns": "123"}
        assert await fast.get_range(k, a.etag, 1000, 5000) == body[1000:6000]
        seen: list[int] = []
        buf = bytearray(len(body) - 7)
        await fast.get_into(k, None, 7, memoryview(buf), seen.append)
        assert buf == body[7:] and seen[-1] == len(buf) and seen == sorted(seen)
        path = tmp_path / "piece"
        for store in (fast, slow):  # a HEAD answered by a GET, and a ranged GET, both paths
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                got = await store.head_by_get(k, 4096, fd)
                assert got is not None and got[0] == a and got[1] == 4096
            finally:
                os.close(fd)
            assert path.read_bytes() == body[:4096]
            piece = bytearray(100)
            await store.get_into(k, a.etag, 50, memoryview(piece))
            assert piece == body[50:150]
    assert await fast.head("missing") is None
    # many requests in parallel share the pool (connections go back only when drained)
    async with trio.open_nursery() as n:
        for k in KEYS * 8:
            n.start_soon(fast.get_range, k, None, 0, 4096)
    assert fast.stats.requests["get"] >= 40 and not fast.stats.errors


async def test_same_errors_as_boto3(seaweed, bucket, s3, creds, monkeypatch) -> None:  # type: ignore
    fast, _ = _stores(seaweed, bucket)
    s3.put_object(Bucket=bucket, Key="pre/k", Body=b"x" * 10)
    info = await fast.head("k")
    assert info is not None
    s3.put_object(Bucket=bucket, Key="pre/k", Body=b"y" * 10)
    with pytest.raises(StaleObject):
        await fast.get_range("k", info.etag, 0, 10)  # If-Match with the old ETag: 412
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    bad = S3Store(bucket, "pre", seaweed.endpoint, retry_seconds=2)
    with pytest.raises(StoreError, match="head of 'k' failed: 403"):
        await bad.head("k")
    with pytest.raises(StoreError, match="SignatureDoesNotMatch|AccessDenied|403"):
        await bad.get_range("k", None, 0, 10)


async def test_listings_match_boto3(seaweed, bucket, s3, creds) -> None:  # type: ignore
    from concurrent.futures import ThreadPoolExecutor
    fast, slow = _stores(seaweed, bucket)
    keys = [f"pre/{k}" for k in KEYS] + [f"pre/many/{i:05d}" for i in range(1100)] + \
        ["pre/ctl\x01char", "pre/a&b=c?d"]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=b"x"), keys))

    async def pages(store: S3Store, prefix: str) -> list[tuple[list, list]]:  # type: ignore
        return [([(o.key, o.size, o.etag, o.mtime_ns) for o in p.objects], p.prefixes)
                async for p in store.list_dir(prefix)]

    async def flat(store: S3Store, prefix: str, after: str = "") -> list[str]:
        return [o.key async for o in store.list_recursive(prefix, after)]

    for prefix in ("", "many/", "with space/", "ünïcode/"):
        assert await pages(fast, prefix) == await pages(slow, prefix), prefix
    assert len([k for p, _ in await pages(fast, "many/") for k in p]) == 1100  # two pages
    everything = await flat(fast, "")
    assert everything == await flat(slow, "") and len(everything) == len(keys)
    assert await flat(fast, "", "many/00500") == await flat(slow, "", "many/00500")
    assert await fast.has_prefix("ünïcode/") and not await fast.has_prefix("nothing/")


async def test_head_many_through_the_engine(seaweed, bucket, s3, creds, monkeypatch) -> None:  # type: ignore
    """The batch path (objcache/store/curl.py) gives what `head` gives, key by key; a
    missing key is None, a refused one an error; a cancelled batch leaves the engine
    working; a closed engine fails at once instead of waiting."""
    fast, _ = _stores(seaweed, bucket)
    keys = [f"b/{i:04d}" for i in range(300)] + KEYS
    for k in keys:
        s3.put_object(Bucket=bucket, Key=f"pre/{k}", Body=k.encode(), Metadata={"k": "v"})
    got: dict[str, object] = {}
    await fast.head_many([*keys, "b/missing"], got.__setitem__)
    assert set(got) == {*keys, "b/missing"} and got["b/missing"] is None
    for k in ("b/0000", "b/0299", *KEYS):
        assert got[k] == await fast.head(k), k
    assert fast.stats.requests["head"] >= len(keys) + 1 and not fast.stats.errors

    with trio.move_on_after(0.001):  # cancelled with most of the batch in flight
        await fast.head_many(keys, lambda k, a: None)
    again: dict[str, object] = {}
    await fast.head_many(keys[:50], again.__setitem__)
    assert all(again[k] == got[k] for k in keys[:50])

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    bad = S3Store(bucket, "pre", seaweed.endpoint, retry_seconds=2)
    refused: dict[str, object] = {}
    await bad.head_many(keys[:3], refused.__setitem__)
    assert all(isinstance(a, StoreError) for a in refused.values()), refused
    bad.close()

    fast.close()
    with trio.fail_after(5), pytest.raises(ConnectionError, match="closed"):
        await fast.head_many(keys[:3], lambda k, a: None)


async def test_engine_transport_failures_are_retried_then_reported(creds) -> None:  # type: ignore
    from objcache.errors import StoreUnavailable
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store("bucket", "pre", f"http://127.0.0.1:{port}", retry_seconds=1)
    assert store.fast is not None
    with trio.fail_after(10):
        with pytest.raises(StoreUnavailable, match="head of 'k'"):
            await store.head("k")
        got: dict[str, object] = {}
        await store.head_many(["a", "b"], got.__setitem__)
    assert all(isinstance(a, StoreUnavailable) for a in got.values()), got
    assert store.stats.retries["head"] >= 1
    store.close()


async def test_an_engine_thread_that_fails_is_replaced(seaweed, bucket, s3, creds,
                                                       monkeypatch, caplog) -> None:  # type: ignore
    from objcache.store.curl import CurlEngine
    fast, _ = _stores(seaweed, bucket)
    s3.put_object(Bucket=bucket, Key="pre/k", Body=b"x")
    take = CurlEngine._take
    broken = [True]

    def take_once_broken(self: CurlEngine) -> None:
        if broken and self._jobs:
            broken.clear()
            raise RuntimeError("injected: a bug in the engine thread")
        take(self)

    monkeypatch.setattr(CurlEngine, "_take", take_once_broken)
    got: dict[str, object] = {}
    with trio.fail_after(10):
        await fast.head_many(["k"], got.__setitem__)
    assert isinstance(got["k"], StoreError) and "engine failed" in str(got["k"])
    assert "the HTTP engine failed" in caplog.text
    with trio.fail_after(10):
        info = await fast.head("k")  # a new thread answers
    assert info is not None and info.size == 1
    fast.close()
