"""A plain PyTorch DDP loop with in-place recovery (tests/integrations/test_inplace.py).

    torchrun --nproc-per-node 2 -m steadytrain.inplace.keeper inplace_worker.py OUT STEPS \
        KILL_AT EVERY KILL_RANK [once|late|instep|repeat|slow|stop]

Every step appends ``{"step", "loss", "pid", "keeper", "restart", "incarnation"}`` to
``OUT/r{RANK}.jsonl``; rank 0 saves the final weights to ``OUT/final.pt``. With ``KILL_AT``
> 0, rank KILL_RANK's first process SIGKILLs itself in step KILL_AT, between its forward
and its backward: the other rank is then blocked in DDP's gradient all-reduce (its
optimizer has not stepped: the survivors recover from their live state, ``EVERY`` 0 takes
no snapshot). With ``late`` it dies after its ``optimizer.step()``, before the step's
loss all-reduce: the survivors stepped too, so only a snapshot (``EVERY`` > 0) can be the
recovery point. With ``instep`` it dies inside its ``optimizer.step()`` of step KILL_AT (a
step post-hook), and the loop has no collective after ``optimizer.step()``: the survivors
finish the step and are live at KILL_AT + 1, whose per-rank state the killed rank's
optimizer pre-hook published. With ``repeat``, every
replacement of the first torchrun attempt dies the same way in its first step (a fault
that repeats: the keeper leaves it to torchrun's whole restart). With ``slow``, the
replacement sleeps past the survivors' 3 s regroup timeout before it joins (the survivor
gives up with InPlaceFallback: whole restart). With ``stop``, rank KILL_RANK SIGSTOPs
itself instead, and every rank runs the hang watchdog with in-place recovery on: the
others decide it hung, its reaper SIGKILLs it, and the keeper replaces it. The batch of a step comes
from the loader's own position (not from the step number) and the model has dropout, so a
loader state or a generator that was not rolled back changes the losses.
"""

import json
import os
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from steadytrain.inplace import Recovery
from steadytrain.monitor.watchdog import HangWatchdog, WatchdogConfig


def write_step(record, step: int, loss: torch.Tensor, incarnation: int) -> None:
    """The step's line of ``r{RANK}.jsonl`` for the ``Run`` workers (inplace_run_worker.py,
    inplace_fsdp_worker.py); ``restart``: torchrun's restart count, "none" without torchrun."""
    line = {"step": step, "loss": loss.item(), "pid": os.getpid()}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "none")
    line.update(restart=restart, incarnation=incarnation)
    record.write(json.dumps(line) + "\n")
    record.flush()


class Loader:
    """A stateful loader: batch n of rank r is a pure function of (n, r)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.position + self.rank)
        self.position += 1
        return torch.randn(8, 32, generator=g), torch.randn(8, 1, generator=g)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


def main() -> None:
    out, steps, kill_at, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kill_rank, mode = int(sys.argv[5]), (sys.argv[6:] or ["once"])[0]
    repeat = mode == "repeat"
    rank = int(os.environ["RANK"])
    incarnation = int(os.environ.get("STEADYTRAIN_INPLACE_INCARNATION", "0"))
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader(rank)
    torch.manual_seed(1 + rank)  # each rank's own dropout stream
    if mode == "slow" and incarnation and first_attempt:
        time.sleep(8)
    recovery = Recovery(
        replicated={"model": model, "optim": optim},
        per_rank={"loader": loader},
        every_steps=every,
        regroup_timeout_s=3 if mode == "slow" else 30,
    )
    step = recovery.start()
    world = int(os.environ["WORLD_SIZE"])

    def watchdog() -> HangWatchdog | None:
        """With ``stop``: the hang watchdog with in-place recovery on, one per group (its
        generation names its hang directory). A 5 s floor: a machine this loaded can stall
        a few seconds, and a false hang would end the run."""
        if mode != "stop":
            return None
        cfg = WatchdogConfig(floor_s=5, warmup_steps=3, init_s=60, poll_s=0.25)
        return HangWatchdog(
            os.path.join(out, "run"),
            rank,
            world,
            attempt=recovery.generation,
            config=cfg,
            nonce="inplace-test",
            in_place=True,
        )

    wd = watchdog()
    current = [step]  # the step being run, for the ``instep`` kill

    def die_in_step(*_: object) -> None:
        if rank == kill_rank and first_attempt and not incarnation and current[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "instep":
        optim.register_step_post_hook(die_in_step)
    # With 3 or more ranks a sum's rounding depends on where a gradient sits in DDP's
    # bucket (gloo's ring sums chunk by chunk); DDP lays its buckets out again after its
    # first step, in the order gradients came, so a DDP rebuilt by a regroup would redo its
    # first step in another layout (1e-8 apart here). find_unused_parameters=True keeps one
    # layout for good (docs/operations.md); 2 ranks (a + b == b + a) need nothing.
    ddp = recovery.wrap(lambda: DistributedDataParallel(model, find_unused_parameters=world > 2))
    record = open(os.path.join(out, f"r{rank}.jsonl"), "a")
    first = step
    while step < steps:
        current[0] = step
        with recovery.step(step) as s:
            x, y = loader.next()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if (
                rank == kill_rank
                and first_attempt
                and kill_at
                and mode not in ("late", "instep")
                and (
                    (step == kill_at and incarnation == 0)
                    or (repeat and incarnation and step == first)
                )
            ):
                os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
            loss.backward()
            optim.step()
            optim.zero_grad()
            late = mode == "late" and rank == kill_rank and step == kill_at
            if late and first_attempt and incarnation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode != "instep":  # a collective after optimizer.step(): the mean loss
                torch.distributed.all_reduce(loss.detach().clone())
        if wd is not None and s.recovered:  # a new group: a new watchdog
            wd.close()
            wd = watchdog()
        elif wd is not None:
            wd.beat(step)
        if not s.recovered:
            line = {"step": step, "loss": loss.item(), "pid": os.getpid(), "keeper": os.getppid()}
            line.update(restart=os.environ["TORCHELASTIC_RESTART_COUNT"], incarnation=incarnation)
            record.write(json.dumps(line) + "\n")
            record.flush()
        step = s.next
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    if wd is not None:
        wd.close()
    recovery.close()


if __name__ == "__main__":
    main()
