"""An FSDP2 loop on ``steadytrain.Run`` with in-place recovery and the memory tier on
(tests/integrations/test_run_inplace_fsdp.py).

    torchrun --nproc-per-node 2 -m steadytrain.inplace.keeper inplace_fsdp_worker.py RUN_DIR \
        STEPS KILL_AT MEMORY_EVERY

The loader and records are ``inplace_run_worker.py``'s: every step appends
``{"step", "loss", "pid", "restart", "incarnation"}`` to ``RUN_DIR/r{RANK}.jsonl``; at the
end every rank gathers the full weights and rank 0 saves them to ``RUN_DIR/final.pt``. With
``KILL_AT`` > 0, rank 0's first process (of torchrun's first attempt) SIGKILLs itself in step KILL_AT between its forward
and its backward (rank 1 blocked in the backward's all-gather). The memory tier snapshots
every MEMORY_EVERY steps (0: off) into ``RUN_DIR/memory``; durable checkpoints every 4 steps.
The model is sharded before ``Run``, so the group is formed first (``form_group``).
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from inplace_worker import Loader, write_step
from torch.distributed.fsdp import fully_shard

from steadytrain.run import Run  # preloaded by the keeper: Run's import-time clock too
from steadytrain.run_inplace import form_group


def main() -> None:
    run_dir, steps, kill_at, every = sys.argv[1], *(int(a) for a in sys.argv[2:5])
    rank = int(os.environ["RANK"])
    incarnation = int(os.environ.get("STEADYTRAIN_INPLACE_INCARNATION", "0"))
    recovery = {"inplace": True, "regroup_timeout_s": 60}
    if not form_group(recovery):  # fully_shard needs the group; Run takes it over
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    loader = Loader(rank)
    torch.manual_seed(1 + rank)  # each rank's own dropout stream
    states = {"model": model, "optim": optim, "loader": loader}
    memory = {"every_steps": every, "dir": os.path.join(run_dir, "memory")}
    checkpoint = {"every_steps": 4, "async_mode": "thread", "memory": memory}
    with Run(run_dir, states, total_steps=steps, checkpoint=checkpoint, recovery=recovery) as run:
        record = open(os.path.join(run_dir, f"r{rank}.jsonl"), "a")
        step = run.start_step
        while step < steps:
            with run.recoverable(step) as s:
                x, y = loader.next()
                loss = torch.nn.functional.mse_loss(model(x), y)
                first = incarnation == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
                if kill_at and rank == 0 and step == kill_at and first:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                optim.step()
                optim.zero_grad()
                run.step_done(step + 1, tokens=8, loss=loss.detach())
            if not s.recovered:
                write_step(record, step, loss, incarnation)
            step = s.next
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(run_dir, "final.pt"))


if __name__ == "__main__":
    main()
