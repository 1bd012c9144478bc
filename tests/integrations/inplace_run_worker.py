"""A DDP loop on ``steadytrain.Run`` with in-place recovery on (tests/integrations/
test_run_inplace.py, and test_run_inplace_slurm.py: under srun's variables, no torchrun).

    torchrun --nproc-per-node 2 -m steadytrain.inplace.keeper inplace_run_worker.py RUN_DIR \
        STEPS KILL_AT KILL_RANK

The model, loader and records are ``inplace_worker.py``'s: every step appends
``{"step", "loss", "pid", "restart", "incarnation"}`` to ``RUN_DIR/r{RANK}.jsonl`` (restart:
torchrun's restart count, "none" without torchrun), rank 0 saves the final weights to
``RUN_DIR/final.pt``. With ``KILL_AT`` > 0, rank KILL_RANK's first process SIGKILLs itself
in step KILL_AT between its forward and its backward (the other rank blocked in DDP's
gradient all-reduce); with ``INPLACE_KILL_KEEPER=1`` it SIGKILLs its keeper first, then
itself (the keeper's death signal would take it too, but only after it may have finished
the step). Checkpoints: every 4 steps, thread-async. ``INPLACE_REGROUP_TIMEOUT_S``: the
``regroup_timeout_s`` (default 60).
"""

import os
import signal
import sys

import torch
from inplace_worker import Loader, write_step
from torch.nn.parallel import DistributedDataParallel

from steadytrain.run import Run  # preloaded by the keeper: Run's import-time clock too


def main() -> None:
    run_dir, steps, kill_at, kill_rank = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    rank = int(os.environ["RANK"])
    incarnation = int(os.environ.get("STEADYTRAIN_INPLACE_INCARNATION", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader(rank)
    torch.manual_seed(1 + rank)  # each rank's own dropout stream
    states = {"model": model, "optim": optim, "loader": loader}
    timeout_s = float(os.environ.get("INPLACE_REGROUP_TIMEOUT_S", "60"))
    recovery = {"inplace": True, "regroup_timeout_s": timeout_s}  # live recovery: no snapshot
    victim = os.getppid() if os.environ.get("INPLACE_KILL_KEEPER") == "1" else os.getpid()
    checkpoint = {"every_steps": 4, "async_mode": "thread"}
    with Run(run_dir, states, total_steps=steps, checkpoint=checkpoint, recovery=recovery) as run:
        ddp = run.wrap(lambda: DistributedDataParallel(model))
        record = open(os.path.join(run_dir, f"r{rank}.jsonl"), "a")
        step = run.start_step
        while step < steps:
            with run.recoverable(step) as s:
                x, y = loader.next()
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                if kill_at and rank == kill_rank and step == kill_at and incarnation == 0:
                    os.kill(victim, signal.SIGKILL)  # the keeper first: it sees no death
                    os.kill(os.getpid(), signal.SIGKILL)  # not left to the death signal's race
                loss.backward()
                optim.step()
                optim.zero_grad()
                run.step_done(step + 1, tokens=8, loss=loss.detach())
            if not s.recovered:
                write_step(record, step, loss, incarnation)
            step = s.next
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(run_dir, "final.pt"))


if __name__ == "__main__":
    main()
