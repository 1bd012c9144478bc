"""The command line: parse, call the library, print. No logic lives here.

Each sub-command is a small module under ``steadytrain.commands`` that declares ``HELP``,
``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> int``; this module turns them
into sub-parsers. Commands stay independent and their imports stay lazy: ``steadytrain
--help`` must not pay for importing torch.

Exit codes: 0 success, 1 a check failed (``verify``), 2 a user-fixable error (a
``SteadyError``: the message names the file and the fix), 130 interrupted. Output piped into
a reader that stops early (``steadytrain inspect --json | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from steadytrain.errors import SteadyError

# Order is the order shown by --help: the data path, then training, then reporting.
COMMANDS = [
    "tokenize",
    "inspect",
    "verify",
    "shuffle",
    "stage",
    "train",
    "demo",
    "checkpoints",
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SteadyError as exc:
        print(f"steadytrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"steadytrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0
    finally:
        # A reader that closed the pipe must not turn the final flush into a traceback.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's exit-time flush cannot fail again
    (the recipe in Python's signal documentation for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
