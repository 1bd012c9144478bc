"""``steadytrain stage DATASET --cache DIR [--steps A:B] [--json]``: pre-warm a node's cache.

Which shards steps A..B read depends on the run's seq_len, global batch, seed and shuffle:
``--config CONFIG [--set key=value ...]`` takes them from the training config itself (the
same arguments ``steadytrain train`` gets), so a staged cache cannot silently disagree
with the job; an explicit ``--seq-len`` etc. still wins.
"""

from __future__ import annotations

import argparse
from typing import Any

from steadytrain.commands._util import add_set_argument
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
    p.add_argument(
        "--config",
        metavar="CONFIG",
        help="take seq_len, global_batch, seed and shuffle from this training config "
        "(a TOML file or a packaged name: demo, small), as `steadytrain train CONFIG` would",
    )
    add_set_argument(
        p, "a --set of the training command, applied to --config (e.g. data.global_batch=768)"
    )
    p.add_argument("--seq-len", type=int, help="run setting (default: --config's, else 2048)")
    p.add_argument(
        "--global-batch", type=int, help="samples per step (default: --config's, else 512)"
    )
    p.add_argument("--seed", type=int, help="run seed (default: --config's, else 0)")
    p.add_argument("--shuffle", help="loader shuffle mode (default: --config's, else global)")
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


_DEFAULTS = {"seq_len": 2048, "global_batch": 512, "seed": 0, "shuffle": "global"}


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """seq_len, global_batch, seed and shuffle (with its settings): a flag, else
    ``--config``'s, else a default."""
    out: dict[str, Any] = {**_DEFAULTS, "shuffle_settings": None}
    if args.config:
        from steadytrain.train.config import load_config, resolve_config_path

        # The dataset is the one being staged (the config's own is usually set by --set).
        cfg = load_config(
            resolve_config_path(args.config), [*args.overrides, f"data.dataset={args.dataset}"]
        )
        out.update(
            seq_len=cfg.data.seq_len,
            global_batch=cfg.data.global_batch,
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
            shuffle_settings=cfg.data.shuffle_settings or None,
        )
    elif args.overrides:
        raise ConfigError("--set applies to a training config: give --config CONFIG too")
    if args.shuffle is not None and args.shuffle != out["shuffle"]:
        out["shuffle_settings"] = None  # the config's settings belong to its own mode
    for key in _DEFAULTS:
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    return out


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.data.read.dataset import TokenDataset, open_shard_cache
    from steadytrain.data.read.format import read_manifest
    from steadytrain.data.read.schedule import schedule_for_run
    from steadytrain.storage.stage import stage
    from steadytrain.storage.store import Store

    steps = _parse_steps(args.steps) if args.steps else None
    settings = run_settings(args)  # a bad config fails here, before any byte moves
    store = Store(args.dataset)
    manifest = read_manifest(store)
    # verify="checksum": every staged file is checked against the manifest, old or new.
    cache = open_shard_cache(args.cache, store, manifest, verify="checksum")
    schedule = None
    if steps is not None:
        ds = TokenDataset(args.dataset, manifest, cache_dir=args.cache)
        schedule = schedule_for_run(
            ds,
            seq_len=settings["seq_len"],
            global_batch=settings["global_batch"],
            seed=settings["seed"],
            shuffle=settings["shuffle"],
            shuffle_settings=settings["shuffle_settings"],
            world_size=args.world_size,
        )
    report = stage(cache, schedule=schedule, steps=steps, workers=args.workers)
    if steps is not None:  # which run the staged shards are for (what decided them)
        report["run_settings"] = {k: settings[k] for k in _DEFAULTS}
    if args.json:
        print_json(report)
    else:
        what = "whole dataset"
        if steps:
            what = (
                f"steps {steps[0]}:{steps[1]} at seq_len {settings['seq_len']}, global batch "
                f"{settings['global_batch']}, seed {settings['seed']}, {settings['shuffle']}"
            )
        print(
            f"staged {report['shards']} shards ({what}) of {report['dataset']} into "
            f"{report['cache_root']}: {report['bytes'] / 1e6:.1f} MB "
            f"({report['bytes_fetched'] / 1e6:.1f} MB fetched, "
            f"{report['bytes_already_cached'] / 1e6:.1f} MB already cached) in "
            f"{report['seconds']:.2f} s, {report['gbps']:.3f} GB/s; all files verified"
        )
    return 0
