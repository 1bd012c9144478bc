"""``steadytrain warm --socket PATH SCRIPT``: a node's warm process (steadytrain.warm)."""

from __future__ import annotations

import argparse

HELP = "keep a node warm: import a training script's modules once, fork each worker"
DESCRIPTION = (
    "Import torch, steadytrain and SCRIPT's top-level imports once, then fork each worker "
    "that torchrun starts with `-m steadytrain.warm.enter SCRIPT ARGS` (with "
    "STEADYTRAIN_WARM_SOCKET=PATH), so a restart -- a spare taking a lost node's seat "
    "included -- does not pay the imports again. Start it on each node before the job "
    "(on a spare when it is provisioned); stop it with SIGTERM after. docs/operations.md, "
    "'A warm spare'."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket", required=True, metavar="PATH", help="the Unix socket, in a private directory"
    )
    p.add_argument("script", metavar="SCRIPT", help="the training script torchrun runs")


def run(args: argparse.Namespace) -> int:  # never returns: the warm process leaves
    from steadytrain.warm.server import serve_then_exit

    serve_then_exit(args.socket, args.script)
