"""``steadytrain demo [--json]``: the whole story on embedded defaults."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the demo on the embedded corpus (the Python standard library's source)",
        description="Tokenize the Python standard library's source into RUN_DIR/data and "
        "summarise it (later stages train, crash, resume and report).",
    )
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<timestamp>")
    p.add_argument("--tokenizer", default="bytes", help="bytes | PATH.json | train:VOCAB")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.demo import run_demo

    def warn(msg: str) -> None:
        print(f"steadytrain demo: warning: {msg}", file=sys.stderr)

    out = run_demo(
        args.run_dir,
        tokenizer=args.tokenizer,
        workers=args.workers,
        quiet=args.quiet or args.json,
        warn=warn,
    )
    if args.json:
        print_json(out)
        return 0
    ds = out["dataset"]
    print(f"run dir: {out['run_dir']}")
    print(
        f"dataset {ds['dataset']}: {ds['num_tokens']:,} tokens, {ds['num_docs']:,} documents, "
        f"{ds['num_shards']} shard(s), {ds['dtype']}, vocab {ds['vocab_size']}, "
        f"tokenized in {ds['tokenize_seconds']:.1f} s "
        f"({ds['tokens_per_s'] / 1e6:.2f} M tokens/s)"
    )
    print(f"fingerprint {ds['fingerprint']}")
    return 0
