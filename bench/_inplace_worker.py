"""The job ``bench/inplace_recovery.py`` kills: a small DDP loop that runs until it is killed.

    torchrun ... [-m steadytrain.inplace.keeper] bench/_inplace_worker.py OUT [watchdog]

Every rank appends ``{"t", "step", "pid", "attempt"}`` to ``OUT/r{RANK}.jsonl`` after each
completed step and writes its pid to ``OUT/pid-r{RANK}`` at start. Under the keeper it runs
with ``Recovery`` (``every_steps`` from ``STEADYTRAIN_BENCH_EVERY``, default 0: the live
recovery point alone, no snapshot); without it, the same loop with a plain
``init_process_group`` (each torchrun attempt starts again from step 0: no restore, so the
whole restart it is measured against pays nothing for loading a checkpoint).

With ``watchdog`` (``bench/inplace_stop.py``), each rank also runs the hang watchdog with
in-place recovery on (``HangWatchdog(in_place=True)``; its deadline floor from
``STEADYTRAIN_BENCH_FLOOR_S``, default 2 s, the run's nonce from ``STEADYTRAIN_BENCH_NONCE``),
beaten after every step: a stopped rank is decided hung, its reaper kills it, and the job
recovers in place. After a regroup each process starts a new watchdog whose ``attempt`` is
the group's generation (one hang directory per generation, ``OUT/run/hangs/attempt-G``).
"""

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from steadytrain.inplace import Recovery
from steadytrain.monitor.watchdog import HangWatchdog, WatchdogConfig


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(out, f"pid-r{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid-r{rank}.tmp"), os.path.join(out, f"pid-r{rank}"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    every = int(os.environ.get("STEADYTRAIN_BENCH_EVERY", "0"))
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=every)
    step = recovery.start()
    ddp = recovery.wrap(lambda: DistributedDataParallel(model))
    record = open(os.path.join(out, f"r{rank}.jsonl"), "a")
    g = torch.Generator().manual_seed(rank)
    floor_s = float(os.environ.get("STEADYTRAIN_BENCH_FLOOR_S", "2"))
    cfg = WatchdogConfig(floor_s=floor_s, warmup_steps=3, init_s=60, poll_s=0.25)

    def watchdog() -> HangWatchdog | None:
        if sys.argv[2:3] != ["watchdog"]:
            return None
        return HangWatchdog(
            os.path.join(out, "run"),
            rank,
            int(os.environ["WORLD_SIZE"]),
            attempt=recovery.generation,
            config=cfg,
            nonce=os.environ.get("STEADYTRAIN_BENCH_NONCE", "bench"),
            in_place=True,
        )

    wd = watchdog()
    while True:
        with recovery.step(step) as s:
            loss = ddp(torch.randn(32, 256, generator=g)).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        if wd is not None and s.recovered:  # a new group: a new watchdog (and hang directory)
            wd.close()
            wd = watchdog()
        elif wd is not None:
            wd.beat(step)
        if not s.recovered:
            line = {"t": time.time(), "step": step, "pid": os.getpid(), "attempt": attempt}
            record.write(json.dumps(line) + "\n")
            record.flush()
        step = s.next


if __name__ == "__main__":
    main()
