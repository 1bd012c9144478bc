"""The reference loop's evaluation: the loss of a fixed set of micro-batches, every
``train.eval_every`` steps, on every rank (nanoGPT's ``estimate_loss``, on the data the
loop has).

The batches are the first ``train.eval_batches`` micro-batches of this rank's share of the
data in a second order (the loop's seed + 1): a fixed sample of the training data, not a
held-out split, read once at start, so that successive evaluations compare and no
evaluation moves the training loader (exact resume is untouched). Every rank evaluates its
own sample (an FSDP model needs every rank in its forward pass; a DDP model's evaluation
has no collective), and the losses are averaged over the ranks with one all-reduce.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from steadytrain.data.read.loader import TokenLoader

__all__ = ["eval_batches", "evaluate"]


def eval_batches(
    datasets: list[Any], *, rank: int, world: int, seed: int, config: Any, count: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of this rank's share of the data, in the order of ``seed``."""
    with TokenLoader(datasets, rank=rank, world_size=world, seed=seed, config=config) as loader:
        batches = iter(loader)
        return [next(batches) for _ in range(count)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    *,
    shift_labels: bool,
    autocast: AbstractContextManager[Any],
) -> float:
    """The mean loss of ``batches`` over every rank (dropout off, no gradients)."""
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            x = batch["input_ids"].to(device)
            y = batch["labels"].to(device)
            if shift_labels:  # data.labels = "same": next-token targets (as in the loop)
                y = F.pad(y[:, 1:], (0, 1), value=-100)
            with autocast:
                _, loss = model(x, y)
            total += loss.detach().double().cpu()
    finally:
        model.train()
    mean = total / max(1, len(batches))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return float(mean)
