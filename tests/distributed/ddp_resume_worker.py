"""One rank of the DDP resume experiment (``test_ddp_exact.py``, ``bench/ddp_resume_layout.py``).

Each variant trains the reference GPT under DDP over gloo for ``--steps`` steps twice: once
uninterrupted, once restarted after step ``--restart-at`` (a fresh model, optimizer and DDP
built from a copy of the state at that step, as a restore does). Rank 0 writes, per variant,
how many parameter tensors differ from the uninterrupted run after each step that followed
the restart, the uninterrupted run's final weights (SHA-256), the warnings steadytrain
raised and the median step time. Variants:

- ``stock``: DDP as it comes;
- ``exact``: ``steadytrain.exact_ddp`` on every DDP;
- ``replay``: stock, but the restarted DDP starts in the bucket layout the first run had
  rebuilt (``torch.distributed._compute_bucket_assignment_by_size`` answered from the saved
  layout): the cause, isolated.

Usage: ddp_resume_worker.py --rank R --world W --init FILE --out JSON [--variants ...]
(``--rank``/``--world`` default to ``RANK``/``WORLD_SIZE``.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadytrain.ddp import exact_ddp
from steadytrain.train.model import GPT, GPTConfig

# Big enough for several 1 MB buckets, so the rebuilt layout is more than one bucket.
MODEL = GPTConfig(vocab_size=257, seq_len=32, n_layer=4, n_head=2, n_embd=128)
BUCKET_CAP_MB = 1
ACCUM = 2  # micro-batches per step: the first under no_sync, as gradient accumulation does


def rebuilt_layout(ddp: DDP) -> list[list[int]] | None:
    """DDP's rebuilt buckets as parameter indices (its logging data), None before."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    return [[int(i) for i in b.split()] for b in text.split(",")] if text else None


@contextlib.contextmanager
def built_in(layout: list[list[int]] | None) -> Iterator[None]:
    """DDP constructed inside starts in ``layout`` (replay), else as it comes."""
    real = dist._compute_bucket_assignment_by_size
    if layout is not None:
        # DDP reverses the list it gets (its initial buckets run last-parameters first).
        dist._compute_bucket_assignment_by_size = lambda *a, **k: (
            layout[::-1],
            [1 << 40] * len(layout),
        )
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = real


def build(variant: str, state: Any = None, layout: list[list[int]] | None = None) -> tuple:
    model = GPT(MODEL, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if state is not None:
        model.load_state_dict(state[0])
        optim.load_state_dict(state[1])
    with built_in(layout if variant == "replay" else None):
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    if variant == "exact":
        exact_ddp(ddp)
    return model, ddp, optim


def step(ddp: DDP, optim: torch.optim.Optimizer, rank: int, s: int) -> None:
    for m in range(ACCUM):
        g = torch.Generator().manual_seed(1000 * s + 10 * m + rank)
        x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=g)
        with ddp.no_sync() if m < ACCUM - 1 else contextlib.nullcontext():
            _, loss = ddp(x, x)
            (loss / ACCUM).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(variant: str, rank: int, steps: int, restart_at: int) -> dict[str, Any]:
    model, ddp, optim = build(variant)
    ref, times = [], []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        step(ddp, optim, rank, s)
        times.append(time.perf_counter() - t0)
        ref.append(params(model))
    model, ddp, optim = build(variant)
    for s in range(1, restart_at + 1):
        step(ddp, optim, rank, s)
    layout = rebuilt_layout(ddp)
    state = copy.deepcopy((model.state_dict(), optim.state_dict()))
    del ddp  # the restart: nothing of this DDP survives but the state and (replay) layout
    model, ddp, optim = build(variant, state, layout)
    differing = []
    for s in range(restart_at + 1, steps + 1):
        step(ddp, optim, rank, s)
        got = params(model)
        differing.append(sum(not torch.equal(a, b) for a, b in zip(got, ref[s - 1], strict=True)))
    digest = hashlib.sha256()
    for t in ref[-1]:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "differing_after_restart": differing,
        "tensors": len(ref[-1]),
        "uninterrupted_sha256": digest.hexdigest(),
        "rebuilt_layout": layout,
        "median_step_s": statistics.median(times[2:]) if len(times) > 2 else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--restart-at", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["stock", "exact"])
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=a.rank, world_size=a.world)
    out = {}
    for variant in a.variants:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[variant] = run(variant, a.rank, a.steps, a.restart_at)
        out[variant]["warnings"] = [
            str(w.message) for w in caught if "steadytrain" in str(w.message)
        ]
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world": a.world, "steps": a.steps, "restart_at": a.restart_at, **out}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
