"""``steadytrain.redact``: which keys and strings are credentials, and the error messages
that can no longer show one (the real-server case is tests/s3/test_redact_s3.py)."""

from __future__ import annotations

import pickle

import pytest

from steadytrain.errors import ConfigError, ReadDeadlineError, StorageError
from steadytrain.redact import REDACTED, is_credential_key, redact, redact_text, secret_values
from steadytrain.storage.s3 import storage_error


@pytest.mark.parametrize(
    "key",
    [
        "key",
        "secret",
        "token",
        "session_token",
        "sessionToken",
        "aws_secret_access_key",
        "aws_region",  # every aws_* setting
        "AWS_PROFILE",
        "password",
        "db_passwd",
        "api_key",
        "apiKey",
        "client_secret",
        "credentials",
        "auth",
        "Authorization",
        "connection_string",
        "sas_token",
        "private_key",
        "X-Amz-Signature",
    ],
)
def test_credential_keys(key: str) -> None:
    assert is_credential_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "tokens",
        "num_tokens",
        "tokens_per_s",
        "expected_tokens_per_s",
        "tokenizer",
        "shard_tokens",
        "dataset",
        "endpoint_url",
        "tracking_uri",
        "seq_len",
        "keep_last",
        "monkey",
        "connect_timeout",
    ],
)
def test_ordinary_keys_stay_readable(key: str) -> None:
    assert not is_credential_key(key)


def test_redact_masks_credentials_and_keeps_the_rest() -> None:
    cfg = {
        "seed": 3,
        "data": {
            "dataset": ["https://bob:pw-one@host/ds", "s3://bucket/ds"],
            "seq_len": 128,
            "tokens_per_s": 1.5,
        },
        "checkpoint": {
            "remote": "s3://ckpt/run",
            "storage_options": {
                "key": "AKIAEXAMPLE",
                "secret": "s3cr3t-value",
                "token": "",  # not set: shown as not set
                "account_key": "az-key",
                "connection_string": "DefaultEndpointsProtocol=https;AccountKey=az",
                "client_kwargs": {"endpoint_url": "http://u:pw-two@127.0.0.1:9000"},
                "region_name": "eu-west-1",
                "credentials": {"type": "service_account", "private_key": "-----BEGIN"},
            },
        },
        "monitor": {
            "tracking_uri": "https://alice:pw-three@mlflow.example:5000",
            "sinks": ["jsonl", "mlflow"],
        },
        "url": "https://h/x?X-Amz-Credential=AK%2F1&X-Amz-Signature=abc123&part=2",
        "aws_access_key_id": "AKIA2",
        "password": None,
    }
    out = redact(cfg)
    text = repr(out)
    for secret in ("pw-one", "pw-two", "pw-three", "AKIAEXAMPLE", "s3cr3t-value", "az-key"):
        assert secret not in text
    assert "AccountKey" not in text and "BEGIN" not in text and "abc123" not in text
    assert "AKIA2" not in text and "AK%2F1" not in text
    opts = out["checkpoint"]["storage_options"]
    assert opts["key"] == opts["secret"] == REDACTED
    assert opts["token"] == ""  # "not set" leaks nothing
    assert opts["credentials"] == {"type": REDACTED, "private_key": REDACTED}  # names kept
    assert opts["region_name"] == "eu-west-1"
    assert opts["client_kwargs"]["endpoint_url"] == f"http://{REDACTED}@127.0.0.1:9000"
    assert out["data"]["dataset"] == [f"https://{REDACTED}@host/ds", "s3://bucket/ds"]
    assert out["data"]["seq_len"] == 128 and out["data"]["tokens_per_s"] == 1.5
    assert out["monitor"]["sinks"] == ["jsonl", "mlflow"]
    assert out["url"].endswith("&part=2") and "X-Amz-Signature=" + REDACTED in out["url"]
    assert out["password"] is None
    assert cfg["checkpoint"]["storage_options"]["secret"] == "s3cr3t-value"  # a copy
    assert redact(out) == out  # idempotent: redacting a redacted config changes nothing


def test_secret_values_scrub_free_text() -> None:
    opts = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "region_name": "eu-west-1"}
    secrets = secret_values(opts)
    assert sorted(secrets) == ["AKIAEXAMPLE", "s3cr3t-value"]
    msg = "signature for s3cr3t-value did not match (key AKIAEXAMPLE, region eu-west-1)"
    assert redact_text(msg, secrets) == (
        f"signature for {REDACTED} did not match (key {REDACTED}, region eu-west-1)"
    )


def test_every_steady_error_message_hides_url_credentials() -> None:
    for cls in (StorageError, ConfigError, ReadDeadlineError):
        err = cls("s3://b/x at http://bob:hunter2@127.0.0.1:9000: storage did not answer")
        assert "hunter2" not in str(err) and f"http://{REDACTED}@127.0.0.1:9000" in str(err)
        assert "hunter2" not in str(pickle.loads(pickle.dumps(err)))  # across processes too


def test_storage_error_never_quotes_a_storage_option() -> None:
    """A client library's message that quotes an option value (here a botocore-like error
    naming the key id) reaches the user with the value masked."""

    class ClientError(Exception):  # what the translation sees: a client-library error
        __module__ = "botocore.exceptions"

    opts = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}
    exc = ClientError("The AWS Access Key Id AKIAEXAMPLE does not exist in our records")
    err = storage_error(
        exc, what="s3://b/x", method="cat_file", url="s3://b/x", storage_options=opts
    )
    assert err is not None and "AKIAEXAMPLE" not in str(err) and REDACTED in str(err)
