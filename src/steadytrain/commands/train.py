"""``steadytrain train CONFIG [--set key=value ...]``: run the reference training loop.

Alone (one process) or under torchrun (one process per rank; every rank gets the same
arguments). ``CONFIG`` is a TOML file, or the name of a packaged config (``demo``, ``small``).
"""

from __future__ import annotations

import argparse

from steadytrain.commands._util import add_set_argument

HELP = "train the small GPT with checkpoints and automatic resume (alone or under torchrun)"
DESCRIPTION = (
    "Train the reference model on a token dataset. Every start resumes from the newest "
    "committed checkpoint in the run directory, so `torchrun --max-restarts N` "
    "recovers from crashes by itself."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config file, or a packaged config name: demo, small")
    add_set_argument(
        p,
        "override a config value, e.g. --set optim.lr=3e-4 --set monitor.alerts.window=50 "
        "--set 'data.dataset=[/data/web, /data/code]' (keys: docs/training.md)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end (rank 0)")


def run(args: argparse.Namespace) -> int:
    import os

    from steadytrain.train.config import load_config, resolve_config_path
    from steadytrain.train.loop import run_training

    cfg = load_config(resolve_config_path(args.config), args.overrides)
    summary = run_training(cfg)
    if args.json and int(os.environ.get("RANK", 0)) == 0:
        from steadytrain.commands._util import print_json

        print_json(summary)
    return 0
