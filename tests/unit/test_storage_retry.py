"""Retry policy: which errors are retried, backoff with jitter, the total deadline."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from steadytrain.errors import ConfigError, ReadDeadlineError
from steadytrain.storage.retry import RetryPolicy, call_with_retry, is_transient
from steadytrain.storage.s3 import storage_options_for, translate_error


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


@pytest.mark.parametrize(
    "exc, transient",
    [
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError(errno.EIO, "InternalError"), True),
        (OSError(errno.EBUSY, "SlowDown"), True),
        (_client_error("ServiceUnavailable", 503), True),
        (_client_error("InternalError", 500), True),
        (_client_error("AccessDenied", 403), False),
        (NoCredentialsError(), False),
        (FileNotFoundError("nope"), False),
        (PermissionError("denied"), False),
        (OSError(errno.EINVAL, "bad request"), False),
        (ValueError("bug"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_retries_transient_then_succeeds():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    retried = []
    policy = RetryPolicy(base_s=0.001, max_backoff_s=0.002, total_s=5)
    out = call_with_retry(fn, what="s3://b/x", policy=policy, on_retry=lambda *a: retried.append(a))
    assert out == "ok" and len(calls) == 3 and len(retried) == 2


def test_permanent_error_is_not_retried():
    calls = []

    def fn():
        calls.append(1)
        raise FileNotFoundError("s3://b/x")

    with pytest.raises(FileNotFoundError):
        call_with_retry(fn, what="s3://b/x", policy=RetryPolicy(base_s=0.001))
    assert len(calls) == 1


def test_deadline_ends_in_read_deadline_error_naming_the_url():
    def fn():
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    policy = RetryPolicy(base_s=0.01, max_backoff_s=0.02, total_s=0.1)
    with pytest.raises(ReadDeadlineError, match="s3://b/shard.*STEADYTRAIN_STORAGE_RETRY_S"):
        call_with_retry(fn, what="s3://b/shard", policy=policy)


def test_backoff_is_jittered_and_capped():
    policy = RetryPolicy(base_s=0.1, max_backoff_s=1.0)
    samples = [policy.backoff(10) for _ in range(200)]
    assert max(samples) <= 1.0 and min(samples) >= 0.0
    assert len({round(s, 6) for s in samples}) > 100  # jitter: not lock-step


def test_policy_validation_and_env(monkeypatch):
    with pytest.raises(ConfigError):
        RetryPolicy(request_timeout_s=0)
    monkeypatch.setenv("STEADYTRAIN_STORAGE_RETRY_S", "7.5")
    monkeypatch.setenv("STEADYTRAIN_STORAGE_TIMEOUT_S", "3")
    p = RetryPolicy.from_env()
    assert (p.total_s, p.request_timeout_s) == (7.5, 3.0)
    monkeypatch.setenv("STEADYTRAIN_STORAGE_RETRY_S", "soon")
    with pytest.raises(ConfigError, match="STEADYTRAIN_STORAGE_RETRY_S"):
        RetryPolicy.from_env()


def test_storage_options_resolution(monkeypatch):
    for var in ("STEADYTRAIN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    assert "client_kwargs" not in storage_options_for("s3://b/x", None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://aws-env:1")
    monkeypatch.setenv("STEADYTRAIN_S3_ENDPOINT", "http://steady-env:2")
    opts = storage_options_for("s3://b/x", None, request_timeout_s=12)
    assert opts["client_kwargs"]["endpoint_url"] == "http://steady-env:2"
    assert opts["config_kwargs"]["read_timeout"] == 12
    given = {"endpoint_url": "http://explicit:3", "config_kwargs": {"read_timeout": 99}}
    opts = storage_options_for("s3://b/x", given)
    assert opts["client_kwargs"]["endpoint_url"] == "http://explicit:3"
    assert opts["config_kwargs"]["read_timeout"] == 99
    assert given == {"endpoint_url": "http://explicit:3", "config_kwargs": {"read_timeout": 99}}
    assert storage_options_for("gs://b/x", {"token": "t"}) == {"token": "t"}


def test_translate_error_messages(monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    so = {"client_kwargs": {"endpoint_url": "http://e:1"}}
    err = translate_error(
        NoCredentialsError(), what="s3://b/m.json", url="s3://b", storage_options=so
    )
    assert (
        "s3://b/m.json" in str(err) and "AWS_ACCESS_KEY_ID" in str(err) and "http://e:1" in str(err)
    )
    err = translate_error(
        PermissionError("Forbidden"),
        what="s3://b/m",
        url="s3://b",
        storage_options={**so, "key": "k"},
    )
    assert "access denied" in str(err) and "storage_options key/secret" in str(err)
    err = translate_error(
        FileNotFoundError("The specified bucket does not exist"),
        what="s3://nob/m",
        url="s3://nob/x",
        storage_options=so,
    )
    assert "bucket 'nob' does not exist" in str(err)
    assert translate_error(ValueError("x"), what="w", url="s3://b", storage_options=so) is None
