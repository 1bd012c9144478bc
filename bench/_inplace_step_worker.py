"""The job ``bench/inplace_step_cost.py`` times: one DDP loop, four ways in turn.

    torchrun --nproc-per-node 2 -m steadytrain.inplace.keeper bench/_inplace_step_worker.py \
        OUT ROUNDS BLOCK WIDTH LAYERS BATCH EVERY

A ``LAYERS`` x Linear(WIDTH, WIDTH) MLP with AdamW (12 x 1024: 12.6 M parameters, ~150 MB of
model and optimizer state), one intra-op thread per rank. In each of ``ROUNDS`` rounds it
runs ``BLOCK`` steps each way, the order of the ways rotating from round to round:

- ``off``: the plain DDP step, no ``Recovery`` around it (not ready for in-place recovery);
- ``live``: inside ``with recovery.step(n)`` with no snapshot (``every_steps=0``, the
  default): the live recovery point alone (live.py: the per-rank states copied and put in
  torchrun's store, the optimizer-step hook);
- ``background``: the same plus a snapshot every ``EVERY`` of these steps (``n`` counts
  the steps taken with ``Recovery``), copied beside the step;
- ``sync``: the same, the whole copy at the start of the step (``background=False``).

Rank 0 appends ``{"round", "mode", "i", "s", "before_s", "before_cpu_s", "load"}`` to
``OUT/steps.jsonl``: seconds for the whole step (snapshot included), seconds of it inside
``Recovery._before`` (the work added at the start of the step; wall clock, and the thread's
CPU time, which the other processes' load does not inflate) and the 1-minute load
average.
"""

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from steadytrain.inplace import Recovery

MODES = ("off", "live", "background", "sync")


def main() -> None:
    out, rounds, block, width, layers, batch, every = sys.argv[1], *map(int, sys.argv[2:8])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=every)
    assert recovery.enabled and recovery.background, "run it under the keeper"
    before, inside = recovery._before, [0.0, 0.0]

    def timed_before(step: int) -> None:  # the time the step spends in Recovery._before
        t, cpu = time.perf_counter(), time.thread_time()
        before(step)
        inside[:] = [time.perf_counter() - t, time.thread_time() - cpu]

    recovery._before = timed_before
    recovery.start()
    ddp = recovery.wrap(lambda: DistributedDataParallel(model))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)

    def train() -> None:
        ddp(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    record = open(os.path.join(out, "steps.jsonl"), "a") if rank == 0 else None
    n = 0  # steps taken inside Recovery: every EVERY-th snapshots
    for _ in range(max(2, 2 * every)):  # warm-up: DDP's bucket rebuild, both snapshots
        with recovery.step(n):
            train()
        n += 1
    for r in range(rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            recovery.background = mode == "background"
            recovery.every_steps = 0 if mode == "live" else every
            for i in range(block):
                t = time.perf_counter()
                inside[:] = [0.0, 0.0]
                if mode == "off":
                    train()
                else:
                    with recovery.step(n):
                        train()
                    n += 1
                dt = time.perf_counter() - t
                if record is not None:
                    line = {"round": r, "mode": mode, "i": i, "s": dt, "before_s": inside[0]}
                    line["before_cpu_s"] = inside[1]
                    line["load"] = os.getloadavg()[0]
                    record.write(json.dumps(line) + "\n")
    if record is not None:
        record.close()
    recovery.close()


if __name__ == "__main__":
    main()
