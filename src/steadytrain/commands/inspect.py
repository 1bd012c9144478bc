"""``steadytrain inspect DATASET [--json]``: what a dataset holds (from its manifest)."""

from __future__ import annotations

import argparse

HELP = "summarise a dataset (tokens, documents, shards, tokenizer, fingerprint)"
DESCRIPTION = (
    "Summarise a dataset from its manifest after checking every listed file "
    "is present with its listed size (use `verify` to check every byte)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", metavar="DATASET", help="dataset directory or URL")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.data.ingest.verify import dataset_info

    info = dataset_info(args.dataset)
    if args.json:
        print_json(info)
        return 0
    tok = info["tokenizer"]
    tok_desc = tok.get("type", "?") + (f" ({tok['source']})" if tok.get("source") else "")
    rows = [
        ("dataset", info["dataset"]),
        ("tokens", f"{info['num_tokens']:,}"),
        ("documents", f"{info['num_docs']:,} (mean {info['mean_doc_tokens']:,} tokens)"),
        (
            "shards",
            f"{info['num_shards']} ({info['min_shard_tokens']:,}..{info['max_shard_tokens']:,} tokens)",
        ),
        ("dtype", info["dtype"]),
        ("vocab_size", info["vocab_size"]),
        ("eos_id", info["eos_id"]),
        ("tokenizer", tok_desc),
        ("bytes", f"{info['bytes']:,}"),
        ("fingerprint", info["fingerprint"]),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
