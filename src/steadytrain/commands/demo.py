"""``steadytrain demo [--json]``: the whole story on embedded defaults."""

from __future__ import annotations

import argparse
import sys

HELP = "run the demo on the embedded corpus (the Python standard library's source)"
DESCRIPTION = (
    "Tokenize the Python standard library's source into RUN_DIR/data, train "
    "the small GPT with 2 processes under torchrun on CPU with asynchronous checkpoints, "
    "inject two crashes (mid-step and mid-save), resume automatically, then print the "
    "goodput report and the planner's recommended checkpoint interval. About a minute "
    "on 2 cores."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<timestamp>")
    p.add_argument("--tokenizer", default="bytes", help="bytes | PATH.json | train:VOCAB")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument(
        "--corpus-bytes", type=int, default=None, help="use only this much of the corpus"
    )
    p.add_argument("--no-train", action="store_true", help="stop after tokenizing")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.demo import run_demo

    def warn(msg: str) -> None:
        print(f"steadytrain demo: warning: {msg}", file=sys.stderr)

    def out(line: str) -> None:
        # Under --json, stdout carries only the JSON object: progress goes to stderr.
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    summary = run_demo(
        args.run_dir,
        tokenizer=args.tokenizer,
        workers=args.workers,
        corpus_limit_bytes=args.corpus_bytes,
        steps=args.steps,
        train=not args.no_train,
        quiet=args.quiet or args.json,
        out=None if args.quiet else out,
        warn=warn,
    )
    if args.json:
        print_json(summary)
        return 0
    print(
        f"done: {summary['steps']} steps, {summary['restarts']} restarts, goodput "
        + (f"{100 * summary['goodput']:.1f} %" if summary["goodput"] is not None else "n/a")
        + f"; run dir {summary['run_dir']}"
    )
    return 0
