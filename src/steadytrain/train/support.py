"""Helpers of the reference training loop, kept out of its way (train.py reads top to bottom)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from steadytrain.train.config import Config

__all__ = [
    "process_start",
    "preflight",
    "loader_metrics",
    "goodput_so_far",
    "weights_digest",
    "close_quietly",
]


def process_start() -> float:
    """When this process was born (start-up cost counts from there, imports included)."""
    try:
        import psutil

        return psutil.Process().create_time()  # includes interpreter start and imports
    except Exception:  # noqa: BLE001 - no psutil or no /proc: from this import on
        return time.time()


def preflight(
    ds: Any, cfg: Config, step: int, world: int, ranks: list[int], ahead: int = 50
) -> None:
    """Say whether this node's cache already holds the shards of the next ``ahead`` steps.

    Only for remote datasets (a local one was size-checked by ``TokenDataset.open``).
    Missing shards are fetched on demand; a spare node pre-warmed with ``steadytrain stage``
    reports ready and starts without a single remote read.
    """
    cache = getattr(ds, "cache", None)
    if cache is None:
        return
    from steadytrain.data.read.schedule import schedule_for_run
    from steadytrain.storage.stage import preflight as cache_preflight

    schedule = schedule_for_run(
        ds,
        seq_len=cfg.data.seq_len,
        global_batch=cfg.data.global_batch,
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
        world_size=world,
        ranks=ranks,
    )
    n = min(ahead, max(1, cfg.train.max_steps - step))
    rep = cache_preflight(cache, schedule, n, start_step=step)
    node = os.environ.get("STEADYTRAIN_NODE", socket.gethostname())
    if rep["ready"]:
        msg = f"cache ready for steps {step + 1}..{step + n} ({rep['shards_needed']} shards)"
    else:
        msg = (
            f"cache misses {len(rep['missing_shards'])} shard(s), "
            f"{rep['missing_bytes'] / 1e6:.1f} MB, first needed at step {step + rep['ready_steps'] + 1}: "
            f"fetched on demand (pre-warm with `steadytrain stage`)"
        )
    print(f"[train] preflight on node {node}: {msg}", flush=True)


def loader_metrics(loader: Any) -> dict[str, Any]:
    """The loader's per-step counters for the ledger (names the meter owns get a prefix)."""
    out = {}
    for k, v in loader.metrics().items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"loader_{k}" if k in _METER_KEYS else k] = v
    return out


_METER_KEYS = {"step", "tokens", "data_wait_s", "compute_s", "checkpoint_block_s", "loss", "t"}


def goodput_so_far(meter: Any) -> str:
    """Goodput so far over every attempt, as the meter's background thread last computed it."""
    value = meter.live.get("goodput")
    return "n/a" if value is None else f"{100 * value:.1f}%"


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes in name order (full tensors, all ranks call)."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()
