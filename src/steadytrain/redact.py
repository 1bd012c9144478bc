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

Free text (``redact_text``) is masked in these shapes, whoever wrote it (a third-party
library's error, a traceback, a log record):

* ``scheme://user:secret@host``, ``scheme://token@host``, and ``scheme://key:sec/ret@host``
  (AWS secret keys hold raw ``/``: a URL typed with one has its ``@`` after a ``/``);
* ``key:secret@host`` without a scheme (botocore quotes the "bucket name" that way);
* URL query parameters named like credentials (``X-Amz-Signature``, ``Signature``,
  ``X-Amz-Credential``, ``aws_secret_access_key``, ``access_token``...);
* ``name=value`` and ``'name': 'value'`` where ``name`` is unmistakably a secret
  (``password``, ``secret_key``, ``session_token``...: ``STRONG_WORDS``), and the value after
  ``Authorization:`` (a ``Bearer``/``Basic`` header);
* every secret this process was given (``register_secrets``): URL credentials seen by the
  CLI or a ``Store``, secret storage options, ``AWS_SECRET_ACCESS_KEY``. So a library that
  echoes a secret in a shape nobody foresaw still cannot print it.

What these guarantee: a secret made of URL characters (letters, digits and
``-._~%!$&()*+,;=:/``; not ``@``, quotes, ``<>`` or white space) is gone from the text in
each shape above, wherever the text around it. The CLI applies ``redact_text`` to every line
it writes (``RedactingStream``) and every log record (``RedactingLogFilter``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import IO, Any

__all__ = [
    "REDACTED",
    "CREDENTIAL_WORDS",
    "SAFE_OPTION_KEYS",
    "redact",
    "redact_text",
    "secret_values",
    "is_credential_key",
    "STRONG_WORDS",
    "register_secrets",
    "known_secrets",
    "url_credentials",
    "url_without_credentials",
    "url_credentials_message",
    "RedactingStream",
    "RedactingLogFilter",
    "install_log_redaction",
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
# No \b in front: "_s3://" or "9s3://" glued to other text is still a URL.
_SCHEME = r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)"
# scheme://userinfo@ : up to the last "@" before the first "/" (as urlsplit reads it), or,
# when the userinfo has a ":", up to the first "@" even past a "/" (a secret with a raw "/").
_USERINFO = re.compile(_SCHEME + r"(?P<userinfo>[^/\s'\"<>]+|[^/\s@'\"<>:]*:[^\s@'\"<>]*)@")
# key:secret@host with no scheme in front (not the tail of a scheme://, nor inside a word).
_BARE_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.\-:/%<])[A-Za-z0-9._~%+\-]+:(?!//)[^\s@'\"<>]+@(?=[A-Za-z0-9\[])"
)
# ?name=value or &name=value inside a URL.
_QUERY = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&;#\s'\"<>]*)")
# name=value, name: 'value', 'name': 'value', "name"="value" in free text.
_ASSIGN = re.compile(
    r"(?P<q1>['\"]?)(?P<name>\b[A-Za-z_][A-Za-z0-9_.-]*)(?P=q1)(?P<sep>\s*(?:=|:(?=\s*['\"]))\s*)"
    r"(?:(?P<q2>['\"])(?P<quoted>[^'\"]*)(?P=q2)|(?P<bare>[^\s,;&'\"<>(){}\[\]]+))"
)
_AUTH_HEADER = re.compile(
    r"(?i)(?P<head>\bauthorization['\"]?\s*[:=]\s*['\"]?(?:(?:bearer|basic|token|digest)\s+)?)"
    r"(?P<value>[^\s'\",;]+)"
)

# Words that make a free-text ``name=value`` a secret on their own (``redact_text``): the
# wider ``CREDENTIAL_WORDS`` would also mask ``key=...`` or ``"eos_token": "..."``, which free
# text (a tokenizer's JSON, a "missing key" message) holds innocently.
STRONG_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "signature",
        "sig",
        "credential",
        "credentials",
        "creds",
        "apikey",
        "bearer",
        "jwt",
        "sas",
    }
)
# "token" is a secret next to one of these (access_token, X-Amz-Security-Token...).
_TOKEN_COMPANIONS = frozenset(
    {"access", "session", "security", "auth", "refresh", "api", "id", "bearer", "oauth", "sas"}
)

# Secrets this process was given (see ``register_secrets``); bounded, longest first.
_KNOWN: dict[str, None] = {}  # an ordered set: the oldest go first when it is full
_KNOWN_LOCK = threading.Lock()
_KNOWN_MAX = 256
_MIN_SECRET_LEN = 4  # for the ``secrets`` a caller passes
_MIN_KNOWN_LEN = 6  # for registered ones, which apply to all text: "pass" must not go


def _words(key: str) -> list[str]:
    return [w.lower() for w in _SPLIT.split(_CAMEL.sub(" ", key)) if w]


def is_credential_key(key: str) -> bool:
    """Whether a value stored under ``key`` must not be shown (see the module docstring)."""
    if key.lower().startswith("aws_"):
        return True
    return any(w in CREDENTIAL_WORDS or w.startswith(_WORD_PREFIXES) for w in _words(key))


def _is_strong_name(name: str) -> bool:
    """A free-text ``name=value`` whose value is a secret (narrower than is_credential_key)."""
    low = name.lower()
    if low.startswith(("aws_secret", "aws_session")):
        return True
    words = _words(name)
    if any(w in STRONG_WORDS or w.startswith(_WORD_PREFIXES) for w in words):
        return True
    return "token" in words and any(w in _TOKEN_COMPANIONS for w in words)


def _mask(value: Any) -> Any:
    return value if value is None or value == "" else REDACTED


def _query_value(m: re.Match[str]) -> str:
    if not is_credential_key(m.group("name")) or not m.group("value"):
        return m.group(0)
    return f"{m.group('sep')}{m.group('name')}={REDACTED}"


def _mask_assignments(text: str) -> str:
    """``_ASSIGN`` with a secret name: value masked. A match whose name is not a secret
    gives back all but its name, so ``A=password=x`` still finds ``password=x``."""
    out: list[str] = []
    pos = 0
    while (m := _ASSIGN.search(text, pos)) is not None:
        value = m.group("quoted") if m.group("q2") else m.group("bare")
        if not value or value == REDACTED or not _is_strong_name(m.group("name")):
            out.append(text[pos : m.end("name")])
            pos = m.end("name")
            continue
        q1, q2 = m.group("q1"), m.group("q2") or ""
        out.append(text[pos : m.start()])
        out.append(f"{q1}{m.group('name')}{q1}{m.group('sep')}{q2}{REDACTED}{q2}")
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def register_secrets(values: Iterable[Any]) -> None:
    """Remember secret strings this process was given, so that ``redact_text`` removes them
    from any text from now on, in whatever shape a library quotes them. Strings shorter
    than 6 characters are ignored (masking them everywhere would garble ordinary text;
    their URL shapes are still masked); the newest 256 are kept (a long-lived process that
    opened many stores)."""
    new = {v for v in values if isinstance(v, str) and len(v) >= _MIN_KNOWN_LEN}
    if not new:
        return
    with _KNOWN_LOCK:
        for value in sorted(new):
            _KNOWN.pop(value, None)
            _KNOWN[value] = None
        while len(_KNOWN) > _KNOWN_MAX:
            del _KNOWN[next(iter(_KNOWN))]


def known_secrets() -> list[str]:
    """The registered secrets (for tests and for scrubbing a child's output)."""
    with _KNOWN_LOCK:
        return sorted(_KNOWN)


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL credentials masked and every one of ``secrets`` (and every
    registered secret) replaced."""
    with _KNOWN_LOCK:
        every = set(_KNOWN) | {
            s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_LEN
        }
    for s in sorted(every, key=len, reverse=True):
        if s in text:  # longest first: a secret may contain a shorter one
            text = text.replace(s, REDACTED)
    if "@" in text:
        text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
        text = _BARE_USERINFO.sub(f"{REDACTED}@", text)
    if "=" in text and ("?" in text or "&" in text):
        text = _QUERY.sub(_query_value, text)
    if "=" in text or ":" in text:
        # The header first: "Authorization=Bearer x" read as name=value would mask "Bearer".
        text = _AUTH_HEADER.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
        text = _mask_assignments(text)
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


# -- credentials inside a storage URL ----------------------------------------------------
# Schemes whose authority is a bucket name: no "@" or ":" is ever legitimate there.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs"})
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)", re.S)


def url_credentials(url: str) -> list[str]:
    """The secrets ``url`` carries (empty when none): a password or, for a bucket scheme
    (``s3``, ``gs``), any ``userinfo@``; a secret with a raw ``/`` (``s3://KEY:SE/CRET@b``);
    a query parameter named like a credential. Local paths carry none (a directory may be
    named ``a:b@c``); ``sftp://user@host`` and ``abfs://container@account`` have no secret."""
    m = _URL.match(url) if isinstance(url, str) else None
    if m is None:
        return []
    scheme, rest = m.group("scheme").lower(), m.group("rest")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    found: list[str] = []
    if "@" in authority:
        userinfo = authority.rpartition("@")[0]
        if ":" in userinfo:
            found += [userinfo, userinfo.split(":", 1)[1]]
        elif scheme in _BUCKET_SCHEMES:
            found.append(userinfo)
    elif ":" in authority and not authority.startswith("[") and "@" in rest:
        port = authority.rsplit(":", 1)[1]
        if scheme in _BUCKET_SCHEMES or not port.isdigit():
            userinfo = rest.split("@", 1)[0]  # KEY:SE/CRET@bucket: the "/" ended the authority
            found += [userinfo, userinfo.split(":", 1)[1]]
    if "?" in rest:
        for pair in re.split(r"[&;]", rest.split("?", 1)[1].split("#", 1)[0]):
            name, _, value = pair.partition("=")
            if value and is_credential_key(name):
                found.append(value)
    return [f for f in found if f]


def url_without_credentials(url: str) -> str:
    """``url`` with its userinfo and credential query parameters removed (what to use)."""
    secrets = url_credentials(url)
    m = _URL.match(url)
    if not secrets or m is None:
        return url
    rest = m.group("rest")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        rest = rest[len(authority.rpartition("@")[0]) + 1 :]
    elif any(rest.startswith(s + "@") for s in secrets):
        rest = rest.split("@", 1)[1]
    if "?" in rest:
        base, _, query = rest.partition("?")
        kept = [p for p in re.split(r"[&;]", query) if not is_credential_key(p.partition("=")[0])]
        rest = base + ("?" + "&".join(kept) if kept else "")
    return f"{m.group('scheme')}://{rest}"


def url_credentials_message(url: str) -> str | None:
    """The error for a storage URL that carries credentials, or None when it carries none.

    steadytrain refuses such URLs instead of using them: a URL travels into ``ps`` output,
    shell history, scheduler logs, the ledger's config record and error messages, where a
    secret must never be; the standard places (environment, profile, storage_options) do
    not. The secrets are registered first, so nothing printed later can show them."""
    secrets = url_credentials(url)
    if not secrets:
        return None
    register_secrets(secrets)
    scheme = url.split("://", 1)[0].lower()
    clean = url_without_credentials(url)
    if scheme in ("s3", "s3a"):
        fix = (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or ~/.aws), "
            "or pass storage_options={'key': ..., 'secret': ...}"
        )
    elif scheme in ("gs", "gcs"):
        fix = "set GOOGLE_APPLICATION_CREDENTIALS, or pass storage_options={'token': ...}"
    else:
        fix = "pass them in storage_options (docs/storage.md)"
    # Registered secrets and the URL shapes do the masking: passing ``secrets`` here would
    # also mask a short password ("pass") inside the advice itself.
    return redact_text(
        f"{url}: credentials in a URL are refused (a URL shows in `ps`, shell history, logs "
        f"and run records); use {clean} and {fix}"
    )


# -- the last line of defence: every line written, every log record -----------------------
class RedactingStream:
    """A text stream that writes ``redact_text`` of every line to ``target``.

    Text is held until a line ends (``\\n`` or ``\\r``, so a progress bar still moves) or
    ``flush()``: a URL written in two pieces is still masked whole. Everything else
    (``fileno``, ``isatty``, ``encoding``, ``buffer``) is the target's; bytes written to
    ``.buffer`` directly bypass it, as do child processes writing to the inherited fd.
    """

    def __init__(self, target: IO[str]) -> None:
        self.target = target
        self._pending = ""
        self._lock = threading.RLock()
        _STREAMS.add(self)

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            cut = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
            if cut >= 0:
                done, self._pending = self._pending[: cut + 1], self._pending[cut + 1 :]
                self.target.write(redact_text(done))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                done, self._pending = self._pending, ""
                self.target.write(redact_text(done))
            self.target.flush()

    def __getattr__(self, name: str) -> Any:
        if name == "target":  # not set yet (a copy being built): no endless recursion
            raise AttributeError(name)
        return getattr(self.target, name)


_STREAMS: weakref.WeakSet[RedactingStream] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A child forked while another thread was writing must not inherit a held lock.
    for stream in list(_STREAMS):
        stream._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RedactingLogFilter(logging.Filter):
    """Rewrites a record's message (and its formatted traceback) through ``redact_text``.

    It never drops a record. A record is changed only when redaction changes something, and
    then in place, so every handler after this filter sees the masked text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: leave it to the handler's own error path
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            # Set only when masking changes it: a handler's own formatException stays in use.
            text = logging.Formatter().formatException(record.exc_info)
            if redact_text(text) != text:
                record.exc_text = redact_text(text)
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


class _RedactFirst(logging.Handler):
    """Sits on the ``steadytrain`` logger: its filter masks a record before any handler
    above (root's, pytest's, a user's) sees it. It prints nothing itself, except in place
    of Python's last-resort handler, which its mere presence would otherwise switch off."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.addFilter(RedactingLogFilter())

    def emit(self, record: logging.LogRecord) -> None:
        last = logging.lastResort
        if last is None or record.levelno < last.level or _other_handlers(record.name):
            return
        last.handle(record)


def _other_handlers(name: str) -> bool:
    """Whether a record of logger ``name`` reaches any handler but ``_RedactFirst``."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(not isinstance(h, _RedactFirst) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def install_log_redaction(handlers: Iterable[logging.Handler] = ()) -> None:
    """Mask credentials in every ``steadytrain.*`` log record (once per process), and in
    every record that reaches ``handlers`` (the CLI's root handler: botocore's too)."""
    top = logging.getLogger("steadytrain")
    if not any(isinstance(h, _RedactFirst) for h in top.handlers):
        top.addHandler(_RedactFirst())
    for handler in handlers:
        if not any(isinstance(f, RedactingLogFilter) for f in handler.filters):
            handler.addFilter(RedactingLogFilter())


install_log_redaction()  # importing steadytrain at all (errors.py imports this) is enough
