"""``steadytrain stage DATASET --cache DIR [--steps A:B] [--json]``: pre-warm a node's cache."""

from __future__ import annotations

import argparse

from steadytrain.errors import ConfigError

HELP = "pre-warm a node-local cache with a dataset (or the shards a step range needs)"
DESCRIPTION = (
    "Fetch a remote dataset's shards into a node-local cache directory, verify every "
    "file against the manifest and report bytes, time and GB/s. With --steps A:B only "
    "the shards that steps [A, B) read are staged (the run settings decide which)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", metavar="DATASET", help="dataset URL (s3://bucket/prefix) or path")
    p.add_argument("--cache", required=True, metavar="DIR", help="node-local cache directory")
    p.add_argument("--steps", metavar="A:B", help="stage only what steps [A, B) need")
    p.add_argument("--seq-len", type=int, default=2048, help="run setting (default 2048)")
    p.add_argument("--global-batch", type=int, default=512, help="samples per step (default 512)")
    p.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    p.add_argument("--shuffle", default="global", help="loader shuffle mode (default global)")
    p.add_argument("--world-size", type=int, default=1, help="ranks in the run (default 1)")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_steps(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A:B with integers, e.g. 0:1000") from None
    if not 0 <= a < b:
        raise ConfigError(f"--steps {text!r}: need 0 <= A < B")
    return a, b


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.data.read.dataset import TokenDataset, open_shard_cache
    from steadytrain.data.read.format import read_manifest
    from steadytrain.data.read.schedule import schedule_for_run
    from steadytrain.storage.stage import stage
    from steadytrain.storage.store import Store

    steps = _parse_steps(args.steps) if args.steps else None
    store = Store(args.dataset)
    manifest = read_manifest(store)
    # verify="checksum": every staged file is checked against the manifest, old or new.
    cache = open_shard_cache(args.cache, store, manifest, verify="checksum")
    schedule = None
    if steps is not None:
        ds = TokenDataset(args.dataset, manifest, cache_dir=args.cache)
        schedule = schedule_for_run(
            ds,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            seed=args.seed,
            shuffle=args.shuffle,
            world_size=args.world_size,
        )
    report = stage(cache, schedule=schedule, steps=steps, workers=args.workers)
    if args.json:
        print_json(report)
    else:
        what = f"steps {steps[0]}:{steps[1]}" if steps else "whole dataset"
        print(
            f"staged {report['shards']} shards ({what}) of {report['dataset']} into "
            f"{report['cache_root']}: {report['bytes'] / 1e6:.1f} MB "
            f"({report['bytes_fetched'] / 1e6:.1f} MB fetched, "
            f"{report['bytes_already_cached'] / 1e6:.1f} MB already cached) in "
            f"{report['seconds']:.2f} s, {report['gbps']:.3f} GB/s; all files verified"
        )
    return 0
