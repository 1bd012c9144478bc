"""``steadytrain shuffle DATASET --out DEST --seq-len L [--seed S]``: offline pre-shuffle."""

from __future__ import annotations

import argparse
import sys

HELP = "rewrite a dataset with its samples in a keyed random order"
DESCRIPTION = (
    "Write DATASET's samples (windows of --seq-len tokens) to DEST in a keyed random "
    "order, so that a loader with shuffle='sequential' streams well-mixed batches "
    "(useful when reading shards in order from object storage). Memory stays bounded "
    "whatever the dataset size; DEST may be a local path or a URL (s3://...)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", metavar="DATASET", help="input dataset (path or URL)")
    p.add_argument("--out", required=True, metavar="DEST", help="output dataset (path or URL)")
    p.add_argument("--seq-len", type=int, required=True, help="training sequence length")
    p.add_argument("--seed", type=int, default=0, help="permutation seed (default 0)")
    p.add_argument(
        "--windows-per-shard",
        type=int,
        default=None,
        help="samples per output shard (default: about the input's median shard size)",
    )
    p.add_argument("--cache-dir", default=None, help="local cache for a remote DATASET")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.data.ingest.shuffle import shuffle_dataset
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.errors import ConfigError

    if args.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1, got {args.seq_len}")
    ds = TokenDataset.open(args.dataset, cache_dir=args.cache_dir)

    def progress(done: int, total: int) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"\rshuffled {done}/{total} samples", end="", file=sys.stderr, flush=True)

    result = shuffle_dataset(
        ds,
        args.out,
        seq_len=args.seq_len,
        seed=args.seed,
        windows_per_shard=args.windows_per_shard,
        progress=progress,
    )
    summary = {
        "out": result.out,
        "num_samples": result.num_samples,
        "num_shards": result.num_shards,
        "num_tokens": result.num_tokens,
        "fingerprint": result.fingerprint,
        "seconds": round(result.seconds, 3),
        "source_fingerprint": ds.fingerprint,
        "seq_len": args.seq_len,
        "seed": args.seed,
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"wrote {result.num_samples} shuffled samples in {result.num_shards} shards to "
            f"{result.out} ({result.seconds:.1f} s); read it with shuffle='sequential', "
            f"seq_len={args.seq_len}"
        )
    return 0
