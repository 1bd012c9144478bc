"""Credentials in storage settings never reach an error message, against a real SeaweedFS.

An endpoint URL with ``user:password@`` is refused by botocore on every request; the error
the user reads names the endpoint (what to go check) with the password masked, and a wrong
secret given in ``storage_options`` is never quoted back."""

from __future__ import annotations

import pytest

from steadytrain.errors import SteadyError, StorageError
from steadytrain.redact import REDACTED
from steadytrain.storage.retry import RetryPolicy
from steadytrain.storage.store import Store

pytestmark = pytest.mark.s3

# No retries past a second; the request itself may take its time: these tests wait for the
# server's refusal (a 2 s request deadline ended one in a timeout instead, at load ~8).
FAST = RetryPolicy(request_timeout_s=30.0, total_s=1.0, base_s=0.05, max_backoff_s=0.1)


def test_endpoint_password_is_masked_in_the_error(s3_server, s3_bucket) -> None:
    """Refused when the store is opened (issue 25): every request would fail inside
    aiohttp, which used to read as a store that does not answer."""
    endpoint = s3_server.endpoint.replace("http://", "http://bob:PLANTED-PW-4471@")
    opts = {**s3_server.storage_options, "client_kwargs": {"endpoint_url": endpoint}}
    with pytest.raises(SteadyError) as info:
        Store(s3_bucket, opts, retry=FAST).read_bytes("manifest.json")
    msg = str(info.value)
    assert "PLANTED-PW-4471" not in msg and "bob" not in msg
    assert f"http://{REDACTED}@127.0.0.1" in msg  # the endpoint is still named
    assert f"use {s3_server.endpoint} and set AWS_ACCESS_KEY_ID" in msg


def test_wrong_secret_is_not_quoted_back(s3_server, s3_bucket) -> None:
    opts = {**s3_server.storage_options, "secret": "PLANTED-SECRET-9902"}
    with pytest.raises(StorageError, match="access denied") as info:
        Store(s3_bucket, opts, retry=FAST).read_bytes("manifest.json")
    assert "PLANTED-SECRET-9902" not in str(info.value)
