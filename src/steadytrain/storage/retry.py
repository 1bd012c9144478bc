"""Retries for remote storage: which errors are transient, and how long to keep trying.

Policy, not mechanism: ``RetryPolicy`` says how hard to try; ``call_with_retry`` runs one
request under it. Transient errors (connection refused or reset, timeouts, 5xx / SlowDown)
are retried with exponential backoff and full jitter until ``total_s`` has passed; every
other error is raised at once so a wrong URL or a bad key fails fast instead of hanging.
A training job whose object store restarts therefore *waits* (up to ``total_s``) and then
continues with the same bytes; a store that stays down ends in ``ReadDeadlineError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from steadytrain.errors import ConfigError, ReadDeadlineError
from steadytrain.settings import check

__all__ = ["RetryPolicy", "is_transient", "call_with_retry", "ENV_VARS"]

T = TypeVar("T")

# OSError errnos s3fs uses for server-side trouble (InternalError/500, SlowDown, 503, 409).
_TRANSIENT_ERRNOS = {errno.EIO, errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.EAGAIN}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
}


# The one place that reads the STEADYTRAIN_STORAGE_* variables (documented in
# docs/storage.md): the variable, the RetryPolicy field it sets, and what it means.
ENV_VARS = {
    "STEADYTRAIN_STORAGE_TIMEOUT_S": ("request_timeout_s", "seconds one request may take"),
    "STEADYTRAIN_STORAGE_RETRY_S": ("total_s", "seconds to keep retrying a request"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How one remote request is retried: the storage layer's config.

    ``request_timeout_s`` bounds a single attempt (it is cancelled, then retried);
    ``total_s`` bounds all attempts together; backoff doubles from ``base_s`` up to
    ``max_backoff_s`` with full jitter so many ranks do not retry in lock-step.
    Storage retry is a property of the cluster's object store rather than of one
    experiment, so it is set per environment: ``from_env`` reads ``ENV_VARS`` (once, when a
    ``Store`` is built without an explicit policy); nothing else reads them.
    """

    request_timeout_s: float = 60.0
    total_s: float = 300.0
    base_s: float = 0.1
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        check(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "use > 0")
        check(self.total_s >= 0, "total_s", self.total_s, "use 0 (no retries) or more seconds")
        check(self.base_s > 0, "base_s", self.base_s, "use > 0")
        check(
            self.max_backoff_s >= self.base_s,
            "max_backoff_s",
            self.max_backoff_s,
            f"use at least base_s ({self.base_s})",
        )

    @classmethod
    def from_env(cls, **overrides: float) -> RetryPolicy:
        """The defaults, then ``ENV_VARS`` from the environment, then ``overrides``."""
        kw: dict[str, float] = {}
        for var, (field, _meaning) in ENV_VARS.items():
            raw = os.environ.get(var)
            if raw:
                try:
                    kw[field] = float(raw)
                    cls(**{field: kw[field]})
                except (ValueError, ConfigError):
                    raise ConfigError(
                        f"{var}={raw!r} is invalid: use a positive number of seconds"
                    ) from None
        kw.update(overrides)
        return cls(**kw)

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full-jitter exponential backoff for the ``attempt``-th retry (0-based)."""
        cap = min(self.max_backoff_s, self.base_s * (2**attempt))
        return (rng or random).uniform(0, cap)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: the network or the server, not the request."""
    if isinstance(
        exc,
        (
            FileNotFoundError,
            PermissionError,
            IsADirectoryError,
            NotADirectoryError,
            FileExistsError,
        ),
    ):
        return False
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, socket.timeout, ConnectionError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("botocore"):
        if name in (
            "NoCredentialsError",
            "PartialCredentialsError",
            "NoRegionError",
            "ParamValidationError",
            "UnknownSignatureVersionError",
        ):
            return False
        if name == "ClientError":
            resp = getattr(exc, "response", None) or {}
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return status >= 500 or resp.get("Error", {}).get("Code") in _TRANSIENT_CODES
        # EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, HTTPClientError...
        return True
    if module.startswith("aiohttp"):
        return True  # ClientConnectorError, ServerDisconnectedError, ClientPayloadError
    if name == "FSTimeoutError":
        return True
    if isinstance(exc, OSError):
        return exc.errno in _TRANSIENT_ERRNOS
    return False


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Run ``fn`` until it succeeds, a non-transient error occurs, or ``policy.total_s`` ends.

    ``what`` names the request in the final error ("s3://b/ds/shards/x.tokens").
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except BaseException as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            delay = policy.backoff(attempt)
            if elapsed + delay > policy.total_s:
                raise ReadDeadlineError(
                    f"{what}: storage did not answer for {elapsed:.1f}s over {attempt + 1} "
                    f"attempts (last error: {type(exc).__name__}: {exc}); check that the "
                    f"endpoint is up, or raise STEADYTRAIN_STORAGE_RETRY_S "
                    f"(now {policy.total_s:g}s)"
                ) from exc
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            time.sleep(delay)
            attempt += 1
