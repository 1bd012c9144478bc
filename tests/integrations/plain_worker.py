"""A plain PyTorch DDP loop on ``steadytrain.Run``, as a user writes it (tests run it under
torchrun, or alone). Faults fire on the first attempt only:

``--crash-at-step N``: rank 1 SIGKILLs itself in the middle of step N;
``--hang-at-step N``: rank 1 sleeps forever in the middle of step N (Run's watchdog must see
it: small deadlines through ``--watchdog-floor``);
``--raise-at-step N``: rank 0 raises ``ValueError`` in the middle of step N;
``--sigterm-at-step N``: rank 0 sends itself SIGTERM in the middle of step N.

``--hold-at-step N --hold-file F``: after step N, with its save and records on disk, rank 0
writes ``F.ready`` and waits until ``F`` exists (a live job another one can meet), on every
attempt. ``--no-checkpoint``: ``checkpoint=False``, the trainer callbacks' path.

``--eval-every N --eval-s S``: after every N-th step both ranks enter ``run.phase("eval")``;
rank 0 evaluates for S seconds (a rank-0-only evaluation) while rank 1 goes on to the next
step and waits for it in the gradient all-reduce. The eval deadline is ``--eval-deadline``
(``monitor.watchdog.phases.eval_s``). ``--stop-in-eval N``: rank 1 stops itself (SIGSTOP)
inside the evaluation after step N, once it has been in the phase for 3 watchdog polls.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from steadytrain import Run, TokenDataset, TokenLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--crash-at-step", type=int, default=0)
    p.add_argument("--hang-at-step", type=int, default=0)
    p.add_argument("--raise-at-step", type=int, default=0)
    p.add_argument("--sigterm-at-step", type=int, default=0)
    p.add_argument("--watchdog-floor", type=float, default=0.0)
    p.add_argument("--hold-at-step", type=int, default=0)
    p.add_argument("--hold-file", default="")
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--eval-deadline", type=float, default=0.0)
    p.add_argument("--stop-in-eval", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    ds = TokenDataset.open(args.data)
    loader = TokenLoader(
        ds, seq_len=32, global_batch=8, micro_batch=2, rank=rank, world_size=world, labels="next"
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(ds.vocab_size, 32), torch.nn.Linear(32, ds.vocab_size)
    )
    ddp = DDP(model) if world > 1 else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = {"model": model, "optim": optim, "loader": loader}
    monitor = None
    if args.watchdog_floor:
        f = args.watchdog_floor
        monitor = {
            "watchdog": {"floor_s": f, "init_s": 6 * f, "warmup_steps": 2, "poll_s": f / 4},
            "flush_interval_s": 0.05,
        }
        if args.eval_deadline:
            monitor["watchdog"].update(grace_s=f, phases={"eval_s": args.eval_deadline})
    checkpoint = False if args.no_checkpoint else {"every_steps": args.every, "keep_last": 2}
    with loader, Run(args.run_dir, states, checkpoint=checkpoint, monitor=monitor) as run:
        step = run.start_step
        while step < args.steps:
            for _ in range(loader.micro_per_step):
                with run.data_wait():
                    batch = next(loader)
                logits = ddp(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
                (loss / loader.micro_per_step).backward()
            here = step + 1
            if first and rank == 1 and here == args.crash_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if first and rank == 1 and here == args.hang_at_step:
                while True:  # a hang in the user's own code, outside any collective
                    time.sleep(1)
            if first and rank == 0 and here == args.raise_at_step:
                raise ValueError(f"user code failed in step {here}")
            if first and rank == 0 and here == args.sigterm_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs at the next bytecode
            optim.step()
            optim.zero_grad(set_to_none=True)
            step = here
            run.step_done(step, tokens=8 * 32, loss=loss.detach())
            if rank == 0 and step == args.hold_at_step:
                hold(run, args.hold_file)
            if args.eval_every and step % args.eval_every == 0:
                with run.phase("eval"):
                    if rank == 0:
                        time.sleep(args.eval_s)  # rank 0 evaluates; rank 1 goes on
                    elif first and step == args.stop_in_eval:
                        time.sleep(3 * run.monitor.watchdog.poll_s)  # its phase is published
                        os.kill(os.getpid(), signal.SIGSTOP)
    if dist.is_initialized():
        dist.destroy_process_group()


def hold(run: Run, path: str) -> None:
    """Say "ready" once this job's save and records are on disk, then wait for ``path``."""
    if run.checkpointer is not None:
        run.checkpointer.wait()
    run.meter.flush()
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    with run.phase("hold"):  # a long wait the watchdog must not take for a hang
        while not os.path.exists(path):
            time.sleep(0.05)


if __name__ == "__main__":
    main()
