"""Credentials never leave the process: the one redaction every record, param and message uses.

A run's config is written to the ledger (``job_start``), logged as MLflow params, shown in
reports, and URLs end up in error messages. Any of them may carry a secret: storage options
(``key``, ``secret``, ``token``, a connection string), an ``aws_*`` setting, a tracking URI
or a dataset URL with ``user:password@``, a presigned URL's signature. ``redact`` returns a
copy with those values replaced by ``REDACTED``; ``redact_text`` does the same inside free
text (an error message), and can also scrub secret values the caller knows
(``secret_values``), wherever they appear.

What is masked, and why it errs on the side of masking:

* a value whose key reads as a credential: a word of the key (split on ``_ - .`` and
  camelCase) is one of ``CREDENTIAL_WORDS`` or starts with ``passw``/``secret``/
  ``credential``/``authori``, or the key starts with ``aws_``. Words, not substrings, so
  ``tokens_per_s`` or ``num_tokens`` stay readable while ``session_token`` does not;
* every entry under a ``storage_options`` key except ``SAFE_OPTION_KEYS`` (endpoint,
  region, timeouts): backends name their credentials freely (``account_key``,
  ``connection_string``, ``sas_token``, a service-account ``token`` dict), so listing the
  safe ones is the only list that cannot fall behind;
* in any string, the ``user:password@`` (or ``token@``) part of a URL, and URL query
  parameters named like credentials (``X-Amz-Signature``, ``sig``, ``access_token``).

``None`` and ``""`` are kept as they are: "not set" leaks nothing and is worth seeing.
Only standard-library imports here: ``errors.py`` uses this module, so it must import
nothing of steadytrain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "REDACTED",
    "CREDENTIAL_WORDS",
    "SAFE_OPTION_KEYS",
    "redact",
    "redact_text",
    "secret_values",
    "is_credential_key",
]

REDACTED = "<redacted>"

# Whole words of a key that mark its value as a credential.
CREDENTIAL_WORDS = frozenset(
    {
        "key",
        "keys",
        "secret",
        "secrets",
        "token",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "creds",
        "session",
        "auth",
        "oauth",
        "apikey",
        "bearer",
        "cookie",
        "jwt",
        "sig",
        "signature",
        "sas",
        "connection",  # connection_string (Azure) holds the account key
        "private",
    }
)
_WORD_PREFIXES = ("passw", "secret", "credential", "authori")

# storage_options entries shown as they are (everything else under storage_options is masked).
SAFE_OPTION_KEYS = frozenset(
    {
        "endpoint_url",  # URLs still go through the user:password@ check
        "region_name",
        "anon",
        "use_ssl",
        "requester_pays",
        "client_kwargs",
        "config_kwargs",
        "connect_timeout",
        "read_timeout",
        "retries",
        "max_attempts",
        "mode",
        "default_block_size",
        "default_cache_type",
    }
)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SPLIT = re.compile(r"[^A-Za-z0-9]+")
# scheme://userinfo@ : everything between "//" and "@" that has no "/", space or quote.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s@'\"<>]+)@")
# ?name=value or &name=value inside a URL.
_QUERY = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&;#\s'\"<>]*)")


def _words(key: str) -> list[str]:
    return [w.lower() for w in _SPLIT.split(_CAMEL.sub(" ", key)) if w]


def is_credential_key(key: str) -> bool:
    """Whether a value stored under ``key`` must not be shown (see the module docstring)."""
    if key.lower().startswith("aws_"):
        return True
    return any(w in CREDENTIAL_WORDS or w.startswith(_WORD_PREFIXES) for w in _words(key))


def _mask(value: Any) -> Any:
    return value if value is None or value == "" else REDACTED


def _query_value(m: re.Match[str]) -> str:
    if not is_credential_key(m.group("name")) or not m.group("value"):
        return m.group(0)
    return f"{m.group('sep')}{m.group('name')}={REDACTED}"


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL credentials masked and every one of ``secrets`` replaced."""
    for s in sorted({s for s in secrets if isinstance(s, str) and len(s) >= 4}, key=len)[::-1]:
        text = text.replace(s, REDACTED)  # longest first: a secret may contain a shorter one
    if "@" in text:
        text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    if "=" in text and "://" in text:
        text = _QUERY.sub(_query_value, text)
    return text


def redact(obj: Any, *, key: str = "", in_options: bool = False) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, strings, scalars) with credentials masked.

    ``key`` is the name ``obj`` is stored under, for a value redacted on its own;
    ``in_options``: ``obj`` lies under a ``storage_options`` key (used in recursion).
    Idempotent: redacting twice gives the same result as once.
    """
    if key and (is_credential_key(key) or (in_options and key not in SAFE_OPTION_KEYS)):
        if isinstance(obj, Mapping):  # keep the names, so the reader sees what was set
            return {k: redact(v, key=str(k), in_options=True) for k, v in obj.items()}
        return _mask(obj)
    if isinstance(obj, Mapping):
        opts = in_options or key == "storage_options"
        return {k: redact(v, key=str(k), in_options=opts) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [redact(v, key="", in_options=in_options) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def secret_values(obj: Any) -> list[str]:
    """The non-empty strings ``redact`` masks in ``obj``: to scrub them from free text (an
    error message that quotes a storage option) with ``redact_text(text, secrets)``."""
    out: list[str] = []

    def walk(orig: Any, red: Any) -> None:
        if isinstance(orig, Mapping) and isinstance(red, Mapping):
            for k, v in orig.items():
                walk(v, red.get(k))
        elif isinstance(orig, (list, tuple)) and isinstance(red, (list, tuple)):
            for a, b in zip(orig, red, strict=True):
                walk(a, b)
        elif isinstance(orig, str) and orig and red == REDACTED:
            out.append(orig)

    walk(obj, redact(obj))
    return out
