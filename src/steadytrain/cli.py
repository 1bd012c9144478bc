"""The command line: parse, call the library, print. No logic lives here.

Each sub-command is a small module under ``steadytrain.commands`` that declares ``HELP``,
``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> int``; this module turns them
into sub-parsers. Commands stay independent and their imports stay lazy: ``steadytrain
--help`` must not pay for importing torch.

Exit codes: 0 success, 1 a check failed (``verify``) or a bug (its traceback is printed),
2 a user-fixable error (a ``SteadyError``: the message names the file and the fix), 130
interrupted. Output piped into a reader that stops early (``steadytrain inspect --json |
head -1``) ends quietly.

Secrets: nothing the CLI prints shows a credential (``steadytrain.redact``). While a command
runs, stdout and stderr are ``RedactingStream``s (every line, a traceback's and a library's
included), log records pass ``RedactingLogFilter``, and the secrets on the command line and in
the environment (``AWS_SECRET_ACCESS_KEY``...) are registered to be masked wherever they
appear. A storage location given with credentials (``s3://KEY:SECRET@bucket/x``) is refused
(exit 2) before any work, naming the URL masked and where credentials go instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from steadytrain.errors import SteadyError
from steadytrain.redact import (
    RedactingLogFilter,
    RedactingStream,
    is_credential_key,
    redact_text,
    register_secrets,
    url_credentials,
    url_credentials_message,
)

# Order is the order shown by --help: the data path, then training, then reporting.
COMMANDS = [
    "tokenize",
    "inspect",
    "verify",
    "shuffle",
    "stage",
    "warm",
    "train",
    "demo",
    "checkpoints",
    "export",
    "report",
    "plan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steadytrain",
        description="Keep GPUs doing useful work during long PyTorch pretraining runs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"steadytrain.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"steadytrain.commands.{name}":
                raise
            continue  # command not built yet
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    restore = _install_redaction(argv)
    try:
        return _run(argv)
    finally:
        restore()


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _refuse_url_credentials(args)
        return int(args.func(args) or 0)
    except SteadyError as exc:
        print(f"steadytrain {args.command}: error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"steadytrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except Exception:
        # A bug: the traceback Python would print, but masked (a library's message may
        # quote a URL or an option), and the exit status an uncaught exception gets.
        sys.stderr.write(redact_text(traceback.format_exc()))
        return 1
    finally:
        # A reader that closed the pipe must not turn the final flush into a traceback.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()


# Argument values that are not storage locations (``--set`` may hold an MLflow tracking URI
# with a password, which the MLflow sink handles and masks).
_NOT_LOCATIONS = frozenset({"func", "command", "overrides"})
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_URL_AT_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _refuse_url_credentials(args: argparse.Namespace) -> None:
    """A dataset, output or checkpoint URL with credentials: exit 2 before any work (the
    library's ``Store`` refuses it too; here ``verify`` cannot report it as a bad file)."""
    for name, value in vars(args).items():
        if name in _NOT_LOCATIONS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and _URL_AT_START.match(item):
                message = url_credentials_message(item)
                if message:
                    raise SteadyError(message)


# Environment variables whose values are secrets (their words), masked in all output.
_SECRET_ENV_WORDS = ("secret", "password", "passwd", "token", "apikey")
# ... unless the variable names where a secret is kept, not the secret (a path shown in
# output must stay readable): HF_TOKEN_PATH, AWS_SHARED_CREDENTIALS_FILE.
_NOT_SECRET_ENV_TAILS = frozenset({"path", "dir", "file", "location", "type", "mode", "url"})


def _secrets_on_the_command_line(argv: list[str]) -> list[str]:
    found: list[str] = []
    for arg in argv:
        for url in _URL_IN_TEXT.findall(arg):
            found += url_credentials(url)
        key, eq, value = arg.partition("=")  # --set checkpoint.storage_options.secret=...
        if eq and "://" not in key and is_credential_key(key.rsplit(".", 1)[-1]):
            found.append(value)
    for var, value in os.environ.items():
        words = var.lower().split("_")
        if (
            len(value) >= 8
            and words[-1] not in _NOT_SECRET_ENV_TAILS
            and (any(w in _SECRET_ENV_WORDS for w in words) or {"api", "key"} <= set(words))
        ):
            found.append(value)
        for url in _URL_IN_TEXT.findall(value):  # STEADYTRAIN_S3_ENDPOINT=http://u:pw@host
            found += url_credentials(url)
    return found


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (the redacting stream while a
    command runs), with the last-resort handler's level and format: output looks the same."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.addFilter(RedactingLogFilter())

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _install_redaction(argv: list[str]) -> Callable[[], None]:
    """Mask secrets in everything this command prints; returns the undo (for callers that
    run ``main`` in-process, tests among them)."""
    register_secrets(_secrets_on_the_command_line(argv))
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    root = logging.getLogger()
    added: list[tuple[logging.Handler, logging.Filter]] = []
    own = None if root.handlers else _StderrHandler()
    if own is not None:
        root.addHandler(own)
    for handler in root.handlers:
        if handler is not own and not any(
            isinstance(f, RedactingLogFilter) for f in handler.filters
        ):
            filt = RedactingLogFilter()
            handler.addFilter(filt)
            added.append((handler, filt))

    def restore() -> None:
        for handler, filt in added:
            handler.removeFilter(filt)
        if own is not None:
            root.removeHandler(own)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass
        sys.stdout, sys.stderr = saved

    return restore


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's exit-time flush cannot fail again
    (the recipe in Python's signal documentation for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
