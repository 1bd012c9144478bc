"""The command line: parse, call the library, print. No logic lives here.

Each sub-command is a small module under ``steadytrain.commands`` exposing
``add_parser(subparsers)`` (which sets ``func``) so commands stay independent and their
imports stay lazy: ``steadytrain --help`` must not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
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
        module.add_parser(sub)
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


if __name__ == "__main__":
    sys.exit(main())
