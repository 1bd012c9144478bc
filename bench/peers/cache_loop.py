"""The rank loop every contender of ``bench/cache_peers.py`` runs: one "training step" =
get this rank's batch, simulated compute, a gloo barrier (what the gradient all-reduce does:
the node's step ends when its slowest rank's does).

Imports only torch and numpy, so it runs in the project's venv (ours and the read-ahead
baseline) and in the peer venv (mosaic streaming, litdata) alike. The rank learns its place
from the usual ``RANK``/``WORLD_SIZE``/``LOCAL_*``/``MASTER_*`` variables the coordinator
sets; the process group is up before the contender builds its dataset, since mosaic and
litdata read the topology from ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np


def rank_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("contender")
    p.add_argument("--url", required=True, help="the contender's data on the store (s3://...)")
    p.add_argument("--cache", required=True, help="the node's cache directory (shared by ranks)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--per-rank", type=int, required=True, help="samples per rank per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--compute-ms", type=float, required=True)
    p.add_argument("--budget-bytes", type=int, required=True, help="node cache budget")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers (peers)")
    if extra is not None:
        extra(p)
    return p.parse_args()


def init_dist() -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def run_rank(next_batch: Callable[[], object], a: argparse.Namespace, build_s: float) -> None:
    """Run ``a.steps`` steps and print one JSON line: per-step waits and walls, the steps
    where a new epoch started (``next_batch`` may set ``epoch_starts`` on itself), and what
    was delivered (samples, a token sum: each contender really reads the bytes)."""
    import torch
    import torch.distributed as dist

    compute_s = a.compute_ms / 1000
    waits, walls, samples, token_sum = [], [], 0, 0
    dist.barrier()
    t_start = time.perf_counter()
    for _ in range(a.steps):
        t0 = time.perf_counter()
        inputs, labels = next_batch()
        t1 = time.perf_counter()
        assert inputs.dtype == torch.int64 and inputs.shape == (a.per_rank, a.seq), inputs.shape
        samples += inputs.shape[0]
        token_sum += int(inputs[:, :64].sum())  # touch the batch, cheaply
        time.sleep(compute_s)  # the accelerator computing
        dist.barrier()  # the gradient all-reduce: the node waits for its slowest rank
        waits.append(t1 - t0)
        walls.append(time.perf_counter() - t0)
    out = {
        "rank": dist.get_rank(),
        "waits": [round(x, 6) for x in waits],
        "walls": [round(x, 6) for x in walls],
        "epoch_starts": list(getattr(next_batch, "epoch_starts", [])),
        "samples": samples,
        "token_sum_head64": token_sum,
        "build_s": build_s,
        "run_s": time.perf_counter() - t_start,
        **(next_batch.extra() if hasattr(next_batch, "extra") else {}),
    }
    dist.barrier()
    print(json.dumps(out), flush=True)


def model_inputs(windows) -> tuple:
    """Fresh int64 inputs and labels from ``[batch, seq + 1]`` token windows (numpy or
    torch, any integer dtype): one whole-batch cast each, as ``TokenLoader`` hands them."""
    import torch

    x = torch.from_numpy(np.asarray(windows)) if not isinstance(windows, torch.Tensor) else windows
    out = torch.empty((2, x.shape[0], x.shape[1] - 1), dtype=torch.int64)
    out[0].copy_(x[:, :-1])
    out[1].copy_(x[:, 1:])
    return out[0], out[1]


class Epochs:
    """Iterate a re-iterable loader forever, noting the step at which each epoch starts."""

    def __init__(self, loader, convert: Callable) -> None:
        self.loader, self.convert = loader, convert
        self.it = iter(loader)
        self.step = 0
        self.epoch_starts = [0]

    def __call__(self):
        try:
            batch = next(self.it)
        except StopIteration:
            self.epoch_starts.append(self.step)
            self.it = iter(self.loader)
            batch = next(self.it)
        self.step += 1
        return self.convert(batch)


def finish() -> None:
    os._exit(0)  # skip the slow worker and shared-memory teardown of some peers
