"""How endpoint, credentials and client settings reach s3fs, and what its errors mean.

Resolution order for an ``s3://`` URL (the first that is set wins, per setting):

* endpoint: ``storage_options["client_kwargs"]["endpoint_url"]`` or
  ``storage_options["endpoint_url"]``, then ``STEADYTRAIN_S3_ENDPOINT``, then
  ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``; none means AWS itself. An endpoint
  with ``user:password@`` is refused (``StorageError``, the password masked).
* credentials: ``storage_options["key"]`` / ``["secret"]`` (and ``["token"]``), then
  botocore's standard chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws``, instance metadata).
* client settings: connect/read timeouts and a small botocore retry count are set here
  because steadytrain retries whole requests itself (``retry.py``), with a deadline;
  anything given in ``storage_options["config_kwargs"]`` wins.

Other protocols (``gs://``, ``az://``, ``file://``) get ``storage_options`` unchanged.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from steadytrain.errors import StorageError
from steadytrain.redact import (
    redact_text,
    register_secrets,
    secret_values,
    url_credentials,
    url_without_credentials,
)

__all__ = [
    "storage_options_for",
    "endpoint_of",
    "translate_error",
    "storage_error",
    "is_missing",
    "S3_PROTOCOLS",
]

S3_PROTOCOLS = ("s3://", "s3a://")
ENDPOINT_ENV = ("STEADYTRAIN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def storage_options_for(
    url: str, given: dict[str, Any] | None, *, request_timeout_s: float = 60.0
) -> dict[str, Any]:
    """The fsspec storage options to open ``url`` with (see the module docstring)."""
    opts = copy.deepcopy(given) if given else {}
    if not url.startswith(S3_PROTOCOLS):
        return opts
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if "endpoint_url" in opts:
        client_kwargs.setdefault("endpoint_url", opts.pop("endpoint_url"))
    source = "storage_options endpoint_url"
    if "endpoint_url" not in client_kwargs:
        for var in ENDPOINT_ENV:
            if os.environ.get(var):
                client_kwargs["endpoint_url"] = os.environ[var]
                source = var
                break
    _refuse_endpoint_credentials(url, client_kwargs.get("endpoint_url"), source)
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    config_kwargs = dict(opts.get("config_kwargs") or {})
    config_kwargs.setdefault("connect_timeout", min(10.0, request_timeout_s))
    config_kwargs.setdefault("read_timeout", request_timeout_s)
    # One botocore retry for a dropped connection; the deadline-aware loop does the rest.
    config_kwargs.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
    opts["config_kwargs"] = config_kwargs
    return opts


def _refuse_endpoint_credentials(url: str, endpoint: Any, source: str) -> None:
    """An endpoint URL with ``user:password@`` makes every request fail inside aiohttp
    ("Cannot combine AUTHORIZATION header..."), which reads as a store that does not
    answer; say what is wrong at once instead, without the password."""
    secrets = url_credentials(endpoint) if isinstance(endpoint, str) else []
    if not secrets:
        return
    register_secrets(secrets)
    raise StorageError(
        f"{url}: the endpoint {endpoint} (from {source}) carries credentials, which are "
        f"refused (they would show in logs and errors); use {url_without_credentials(endpoint)} "
        f"and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
        f"storage_options={{'key': ..., 'secret': ...}}"
    )


def endpoint_of(storage_options: dict[str, Any]) -> str:
    return (storage_options.get("client_kwargs") or {}).get("endpoint_url") or "AWS S3"


def _credential_source(storage_options: dict[str, Any]) -> str:
    if storage_options.get("key"):
        return "storage_options key/secret"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables"
    if os.environ.get("AWS_PROFILE"):
        return f"AWS_PROFILE={os.environ['AWS_PROFILE']}"
    return "botocore's default chain (~/.aws, instance metadata)"


def translate_error(
    exc: BaseException, *, what: str, url: str, storage_options: dict[str, Any]
) -> StorageError | None:
    """A clear ``StorageError`` for a permanent storage error, or None to re-raise as is."""
    name = type(exc).__name__
    endpoint = endpoint_of(storage_options) if url.startswith(S3_PROTOCOLS) else url
    fix_creds = (
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
        "storage_options={'key': ..., 'secret': ...}"
    )
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StorageError(f"{what}: no credentials found for {endpoint}; {fix_creds}")
    if isinstance(exc, PermissionError):
        return StorageError(
            f"{what}: access denied by {endpoint} ({exc}); the credentials from "
            f"{_credential_source(storage_options)} are wrong or lack permission; {fix_creds}"
        )
    if isinstance(exc, FileNotFoundError):
        msg = str(exc)
        if url.startswith(S3_PROTOCOLS) and "bucket" in msg.lower():
            bucket = url.split("://", 1)[-1].split("/", 1)[0]
            return StorageError(
                f"{what}: bucket {bucket!r} does not exist at {endpoint}; create it or fix the URL"
            )
        return StorageError(f"{what} does not exist")
    return None


# Exceptions from the client libraries that are storage trouble, never a steadytrain bug.
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs")


def is_missing(exc: BaseException) -> bool:
    """``exc`` (from a ``Store`` call) says only that the object (not its bucket, not our
    access to it) is missing. Matched on the message's form (``translate_error``), not on
    the word "bucket", which may be part of the URL."""
    return (
        isinstance(exc, StorageError)
        and isinstance(exc.__cause__, FileNotFoundError)
        and str(exc).endswith(" does not exist")
    )


def _is_client_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return isinstance(exc, OSError) or module.split(".", 1)[0] in _CLIENT_MODULES


def storage_error(
    exc: BaseException, *, what: str, method: str, url: str, storage_options: dict[str, Any]
) -> StorageError | None:
    """``translate_error``, or for any other client-library error a ``StorageError`` naming
    the call, the endpoint and what to check; None for errors that are not storage trouble
    (a bug: re-raise it as it is)."""
    err = translate_error(exc, what=what, url=url, storage_options=storage_options)
    if err is None and _is_client_error(exc):
        # Storage trouble without a better name (a 400, a malformed response): still the
        # user's to fix, so a message and not a traceback.
        err = StorageError(
            f"{what}: {method} failed ({type(exc).__name__}: {exc}); check the URL, "
            f"the endpoint ({endpoint_of(storage_options)}) and the credentials"
        )
    secrets = secret_values(storage_options)
    if err is not None and secrets:  # a client message may quote an option: never a secret
        err = StorageError(redact_text(str(err), secrets))
    return err
