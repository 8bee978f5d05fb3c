"""objcache's SigV4 signer for bodiless S3 requests (objcache/store/signed.py) gives the
signature botocore's S3SigV4Auth gives for the same request, time and credentials (the
real-server proof, with awkward keys, is tests/integration/test_s3_signed.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import botocore.auth
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from objcache.store.signed import SigV4

NOW = datetime(2026, 11, 24, 8, 30, 5, tzinfo=UTC)
URLS = ["http://127.0.0.1:8333/bkt/pre/plain.bin",
        "http://127.0.0.1:8333/bkt/pre/with%20space/and%2Bplus.bin",
        "https://bkt.s3.us-east-1.amazonaws.com/%C3%BCn%C3%AFcode/%E2%82%ACuro~tilde.bin",
        "http://127.0.0.1:8333/bkt/?delimiter=%2F&encoding-type=url&list-type=2"
        "&prefix=pre%2Fdir%2F"]


@pytest.mark.parametrize("token", [None, "a-session-token"])
@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_signature_is_botocores(monkeypatch: pytest.MonkeyPatch, method: str, url: str,
                                    token: str | None) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    ours = SigV4("us-east-1").sign(method, url, {"Range": "bytes=0-9"}, creds, NOW)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: NOW.replace(tzinfo=None))
    req = AWSRequest(method=method, url=url, headers={})  # (botocore also signs Range)
    S3SigV4Auth(creds.get_frozen_credentials(), "s3", "us-east-1").add_auth(req)
    theirs = dict(req.headers.items())
    assert ours["x-amz-date"] == theirs["X-Amz-Date"]
    assert ours["Authorization"] == theirs["Authorization"]
    assert ours["Range"] == "bytes=0-9"
