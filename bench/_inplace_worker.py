"""The job ``bench/inplace_recovery.py`` kills: a small DDP loop that runs until it is killed.

    torchrun ... [-m steadytrain.inplace.keeper] bench/_inplace_worker.py OUT

Every rank appends ``{"t", "step", "pid", "attempt"}`` to ``OUT/r{RANK}.jsonl`` after each
completed step and writes its pid to ``OUT/pid-r{RANK}`` at start. Under the keeper it runs
with ``Recovery`` (snapshots every step); without it, the same loop with a plain
``init_process_group`` (each torchrun attempt starts again from step 0: no restore, so the
whole restart it is measured against pays nothing for loading a checkpoint).
"""

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from steadytrain.inplace import Recovery


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
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=1)
    step = recovery.start()
    ddp = recovery.wrap(lambda: DistributedDataParallel(model))
    record = open(os.path.join(out, f"r{rank}.jsonl"), "a")
    g = torch.Generator().manual_seed(rank)
    while True:
        with recovery.step(step) as s:
            loss = ddp(torch.randn(32, 256, generator=g)).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        if not s.recovered:
            line = {"t": time.time(), "step": step, "pid": os.getpid(), "attempt": attempt}
            record.write(json.dumps(line) + "\n")
            record.flush()
        step = s.next


if __name__ == "__main__":
    main()
