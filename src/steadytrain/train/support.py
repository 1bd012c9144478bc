"""Helpers of the reference training loop, kept out of its way (loop.py reads top to bottom)."""

from __future__ import annotations

import hashlib
import math
import os
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from steadytrain.errors import ConfigError
from steadytrain.monitor.appender import Appender
from steadytrain.monitor.extras import loader_fields
from steadytrain.monitor.ranks import node_name
from steadytrain.run_birth import process_start
from steadytrain.storage.prefetch import Prefetcher
from steadytrain.storage.stage import preflight as cache_preflight
from steadytrain.train.config import DataSection

__all__ = [
    "check_world_sizes",
    "process_start",
    "preflight",
    "say_fetched",
    "start_prefetchers",
    "StepTrace",
    "loader_metrics",
    "goodput_so_far",
    "weights_digest",
]


def say(msg: str) -> None:
    """A ``[train]`` progress line. Progress goes to stderr, so ``steadytrain train --json``
    leaves stdout to the JSON summary alone (as ``demo --json`` does)."""
    print(f"[train] {msg}", file=sys.stderr, flush=True)


def check_world_sizes(
    global_batch: int,
    micro_batch: int,
    world: int,
    per_node: int,
    nnodes: tuple[int, int] | None = None,
) -> str | None:
    """Refuse a world size that cannot split the global batch; warn about the others.

    Every rank reads ``global_batch / world`` samples per step in whole micro-batches, so a
    world size ``W`` works only when ``W x micro_batch`` divides ``global_batch`` (DESIGN
    invariant 1). An elastic launch (``torchrun --nnodes MIN:MAX``) may run at any
    ``nodes x per_node`` in that range: a job that works at 4 nodes and cannot work at 3
    fails only when a node is lost, hours in. torchrun does not tell a worker MIN:MAX, so
    ``nnodes`` comes from ``train.elastic_nnodes``.

    Raises ``ConfigError`` naming both numbers when ``world`` itself does not fit; returns
    a warning listing the node counts in ``nnodes`` that would fail (``None`` if none do).
    """

    def fits(w: int) -> bool:
        return global_batch % (w * micro_batch) == 0

    per_node = max(1, per_node)
    counts = range(nnodes[0], nnodes[1] + 1) if nnodes else range(0)
    good = [n for n in counts if fits(n * per_node)]
    bad = [n for n in counts if not fits(n * per_node)]
    # The smallest global batch that this world size and every allowed one split evenly.
    fix = math.lcm(world * micro_batch, *(n * per_node * micro_batch for n in counts))
    if nnodes:
        fix_text = f"{fix} (it fits every world size of --nnodes {nnodes[0]}:{nnodes[1]})"
    else:
        fix_text = str(fix)
    if not fits(world):
        nodes = f" ({world // per_node} node(s) x {per_node})" if world % per_node == 0 else ""
        other = f", or launch on {_either(good)} node(s)" if good else ""
        raise ConfigError(
            f"world size {world}{nodes} cannot split data.global_batch={global_batch} into "
            f"whole micro-batches of data.micro_batch={micro_batch}: {world} ranks x "
            f"{micro_batch} = {world * micro_batch} does not divide {global_batch}. Set "
            f"data.global_batch to a multiple of {fix_text}{other}"
        )
    if not bad:
        return None
    worlds = ", ".join(f"{n} node(s) = world size {n * per_node}" for n in bad)
    return (
        f"warning: train.elastic_nnodes = {nnodes[0]}:{nnodes[1]} allows world sizes that "
        f"cannot split data.global_batch={global_batch} into micro-batches of "
        f"data.micro_batch={micro_batch}: {worlds}. If the job shrinks or grows to one of "
        f"them, every attempt there is refused. Set data.global_batch to a multiple of "
        f"{fix_text}" + (f", or keep --nnodes to {_either(good)} node(s)" if good else "")
    )


def _either(counts: list[int]) -> str:
    """``[2]`` -> "2"; ``[2, 4, 5]`` -> "2, 4 or 5"."""
    words = [str(n) for n in counts]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _node() -> str:
    return node_name()


def _cached(loader: Any) -> list[tuple[int, Any]]:
    """(index, cache) of every dataset the loader reads through a node-local ShardCache."""
    caches = [(d, getattr(ds, "cache", None)) for d, ds in enumerate(loader.datasets)]
    return [(d, c) for d, c in caches if c is not None]


def _schedule(loader: Any, dataset: int, ranks: list[int]) -> Any:
    """The (step, shard) schedule of one dataset for ``ranks``, from the loader's own
    sampler: with a blend, each dataset's schedule depends on the weights."""
    world = loader.world_size
    return lambda a, b: loader.shards_for_steps(
        a, b, ranks=ranks, world_size=world, dataset=dataset
    )


def preflight(loader: Any, step: int, total: int, ranks: list[int], ahead: int = 50) -> None:
    """Say whether this node's cache already holds the shards of the next ``ahead`` steps.

    Only for remote datasets (a local one was size-checked by ``TokenDataset.open``).
    Missing shards are fetched on demand; a spare node pre-warmed with ``steadytrain stage``
    reports ready and starts without a single remote read.
    """
    n = min(ahead, max(1, total - step))
    for d, cache in _cached(loader):
        rep = cache_preflight(cache, _schedule(loader, d, ranks), n, start_step=step)
        if rep["ready"]:
            msg = f"cache ready for steps {step + 1}..{step + n} ({rep['shards_needed']} shards)"
        else:
            first = step + rep["ready_steps"] + 1
            msg = (
                f"cache misses {len(rep['missing_shards'])} shard(s), "
                f"{rep['missing_bytes'] / 1e6:.1f} MB, first needed at step {first}: "
                f"fetched on demand (pre-warm with `steadytrain stage`)"
            )
        where = f"dataset {d}: " if len(loader.datasets) > 1 else ""
        say(f"preflight on node {_node()}: {where}{msg}")


def say_fetched(loader: Any, rank: int, always: bool) -> None:
    """Say how much this process (its reads and its node's prefetcher, which runs on local
    rank 0) fetched from remote storage because the node's cache did not hold it.

    The preflight says at start what is missing; this says, on the way out, what it cost:
    a spare staged with ``steadytrain stage`` says 0, a partly staged one says how much it
    fetched. ``always``: say it even when nothing was fetched (local rank 0).
    """
    caches = _cached(loader) if hasattr(loader, "datasets") else []  # any loader may come
    files = nbytes = 0
    for _, cache in caches:
        m = cache.metrics()
        files, nbytes = files + m["downloads"], nbytes + m["bytes_fetched"]
    if caches and (always or files):
        say(
            f"node {_node()} rank {rank}: fetched {files} shard file(s) ({nbytes} bytes, "
            f"{nbytes / 1e6:.1f} MB) its cache did not hold (not staged)"
        )


def start_prefetchers(
    loader: Any, ranks: list[int], data: DataSection, total: int
) -> list[Prefetcher]:
    """One prefetcher per remote dataset, fetching the shards ``ranks`` read in the next
    ``data.prefetch_steps`` steps; the loader's ``on_step`` slides their horizon."""
    out = [
        Prefetcher(
            cache,
            _schedule(loader, d, ranks),
            horizon_steps=data.prefetch_steps,
            budget_bytes=data.cache_budget_bytes or None,
            start_step=loader.step,
            total_steps=total,
        )
        for d, cache in _cached(loader)
    ]
    previous = loader.on_step

    def on_step(step: int) -> None:
        for pf in out:
            pf.advance(step)
        if previous is not None:
            previous(step)

    if out:
        loader.on_step = on_step
    return out


class StepTrace:
    """``RUN_DIR/trace-rank{R}.jsonl``: the loss and the sample ids of every step, one line
    per step and attempt (appended), for exact-resume checks. Does nothing when off.

    A full or failing disk (or a symlink in the file's place) never stops training: lines
    wait in a bounded buffer and are written when the disk works again; lines dropped past
    the bound leave one ``records_lost`` line (monitor/appender.py)."""

    def __init__(
        self, run_dir: str, rank: int, world: int, attempt: int, attempt_id: float, enabled: bool
    ) -> None:
        path = os.path.join(run_dir, f"trace-rank{rank}.jsonl")
        self._f = Appender(path) if enabled else None
        self._fixed = {
            "attempt": attempt,
            "attempt_id": attempt_id,
            "node": _node(),
            "world": world,
            "rank": rank,
        }
        self._ids: list[int] = []

    def begin(self, attempt_id: float) -> None:
        """A step (or a step done again) begins, in ``Run``'s attempt ``attempt_id``: after
        an in-place recovery a survivor's redone step is the new attempt's (the process and
        its torchrun attempt stay), and the ids its failed try had noted are not that
        step's."""
        self._fixed["attempt_id"] = attempt_id
        self._ids = []

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Note one micro-batch's sample ids (skipped when off: ``tolist`` is not free)."""
        if self._f is not None:
            self._ids.extend(batch["sample_ids"].tolist())

    def write(self, step: int, loss: float, local_loss: float, lr: float) -> None:
        if self._f is None:
            return
        rec = {"step": step, **self._fixed, "loss": loss, "local_loss": local_loss, "lr": lr}
        self._f.append([{**rec, "sample_ids": self._ids}])
        self._ids = []

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loader_metrics(loader: Any) -> dict[str, Any]:
    """The loader's per-step counters for the ledger (names the meter owns get a prefix)."""
    return loader_fields(loader.metrics())


def goodput_so_far(meter: Any) -> str:
    """Goodput so far over every attempt, as the meter's background thread last computed it."""
    value = meter.live.get("goodput")
    return "n/a" if value is None else f"{100 * value:.1f}%"


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes in name order (full tensors, all ranks call)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
