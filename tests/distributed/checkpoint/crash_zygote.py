"""The saving job of the crash matrix (test_checkpoint_crash.py), and the zygote that forks it.

The matrix kills a saving process 54 times. Starting a fresh interpreter per kill would pay
a torch import each time (seconds on a loaded machine); forking the pytest process would
copy whatever locks its other threads hold at that moment (meter writers, gloo, thread
pools) into a child that may then deadlock. This script is started once, with
``OMP_NUM_THREADS=1``: it imports torch and steadytrain, stays single-threaded, and forks one
child per kill -- what multiprocessing's forkserver does, with the preload this test needs.

Protocol, one JSON object per line. On stdin: ``{"run": {directory, mode, remote, log}}``
forks a child, which answers ``{"ready": pid}`` on stdout once it has joined its 1-rank
gloo group and restored (also when it failed before that: the traceback is in
``LOG.err``); ``{"reap": pid}`` waits for that child and answers ``{"reaped": pid}``.
End of stdin ends the zygote.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.checkpoint import Checkpointer


class Cursor:
    """A loader stand-in: its state names the step it was saved at."""

    def __init__(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))  # ~1 MiB of state


def _reply(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def run_job(directory: str, mode: str, remote: str | None, log: str) -> None:
    """Save at every step, every parameter filled with the step number, until killed."""
    # A 1-rank group needs no rendezvous port: an in-process store cannot collide with
    # anything else on the machine. DCP's process mode reads MASTER_ADDR for its daemon.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)  # the host has 2 busy cores: no OpenMP pool wake-ups
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, loader = make_model(), Cursor()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def on_event(e: dict) -> None:
        if e["type"] == "checkpoint" and e["ok"]:
            with open(log, "a") as f:
                f.write(f"{e['step']}\n")

    ckpt = Checkpointer(
        directory, every_steps=1, keep_last=2, async_mode=mode, remote=remote, on_event=on_event
    )
    start = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
    _reply({"ready": os.getpid()})
    for step in range(start + 1, start + 10_000):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        loader.cursor = step
        ckpt.maybe_save(step, {"model": model, "optim": optim, "loader": loader})


def _child(args: dict[str, Any]) -> None:
    """The forked child: run the job; never return into the zygote's loop."""
    try:
        run_job(**args)
    except BaseException:
        with open(f"{args['log']}.err", "a") as f:
            f.write(traceback.format_exc())
        _reply({"ready": os.getpid()})  # unblock the test; it reports LOG.err at the end
    finally:
        os._exit(0)


def warm_up() -> None:
    """Build a model and take one optimizer step before forking: torch imports much of
    itself lazily on first use (seconds of it for the optimizer), and a child should not
    pay that at every kill. It starts no thread (``OMP_NUM_THREADS=1``)."""
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 256)).sum().backward()
    optim.step()


def serve() -> None:
    warm_up()
    while line := sys.stdin.readline():
        msg = json.loads(line)
        if "run" in msg:
            if os.fork() == 0:
                _child(msg["run"])
        elif "reap" in msg:
            os.waitpid(msg["reap"], 0)
            _reply({"reaped": msg["reap"]})


if __name__ == "__main__":  # DCP's process mode re-imports __main__ in its daemon
    serve()
