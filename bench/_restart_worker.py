"""The job ``bench/restart_phases.py`` restarts: a small DDP loop on ``steadytrain.Run``
under torchrun, async checkpoints every 2 steps, and one fault per attempt until
``--faults`` attempts have failed (``TORCHELASTIC_RESTART_COUNT`` counts them), each 5 steps
after the attempt's restored step:

- ``kill``: rank 1 SIGKILLs itself in the middle of the step;
- ``sigterm``: rank 1 stops making progress (a hang in its own code, before the gradient
  all-reduce), rank 0 blocks inside that all-reduce -- a C++ call -- and 1 s later gets
  SIGTERM, as a preempted or operator-stopped rank does.

Before the fault the rank appends ``{"attempt", "mode", "t"}`` (``t``: the kill) to
``RUN_DIR/faults.jsonl``, fsync'd: the bench measures from there to the next productive
step.

    torchrun ... bench/_restart_worker.py --run-dir DIR --mode kill --faults 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadytrain import Run

# The fault's step after the restored one: the save of restored + 2 has committed by then.
FAULT_AFTER = 5


def note_fault(run_dir: str, attempt: int, mode: str, t: float) -> None:
    with open(os.path.join(run_dir, "faults.jsonl"), "a") as f:
        f.write(json.dumps({"attempt": attempt, "mode": mode, "t": t}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--mode", choices=("kill", "sigterm"), default="kill")
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.1, help="each step's simulated compute")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    faulty = attempt < args.faults
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = {"model": model, "optim": optim}
    ckpt = {"every_steps": 2, "keep_last": 2}
    # Run makes the process group (torchrun's environment), so its init is the start-up's
    # group phase; DDP wraps the restored model inside (it broadcasts rank 0's weights).
    with Run(args.run_dir, states, checkpoint=ckpt, monitor={"flush_interval_s": 0.05}) as run:
        if not dist.is_initialized():  # Run makes a group only for more than one rank
            dist.init_process_group("gloo")
        ddp = DDP(model)
        step = run.start_step
        fault_at = run.start_step + FAULT_AFTER if faulty else -1
        while step < args.steps:
            here = step + 1
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(here * 2 + rank))
            loss = (ddp(x) - x).pow(2).mean() if here != fault_at else None
            if here == fault_at and args.mode == "kill":
                loss = (ddp(x) - x).pow(2).mean()
                if rank == 1:
                    note_fault(args.run_dir, attempt, "kill", time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
            if here == fault_at and args.mode == "sigterm":
                loss = (ddp(x) - x).pow(2).mean()
                if rank == 1:
                    while True:  # no progress: rank 0 waits in the all-reduce
                        time.sleep(0.1)
                threading.Timer(1.0, _sigterm_self, (args.run_dir, attempt)).start()
            loss.backward()  # rank 0 blocks here in a sigterm fault
            time.sleep(args.step_s)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step = here
            run.step_done(step, tokens=64 * 256, loss=loss.detach())


def _sigterm_self(run_dir: str, attempt: int) -> None:
    note_fault(run_dir, attempt, "sigterm", time.time())
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
