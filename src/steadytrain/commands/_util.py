"""Small helpers shared by command modules (JSON output, the --set flag)."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(obj: Any) -> None:
    """Print one JSON object on stdout (the ``--json`` contract)."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def add_set_argument(parser: Any, help: str) -> None:
    """``--set KEY=VALUE`` (repeatable), the training config's override flag."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )
