"""One rank of the process-mode daemon test: saves with async_mode="process", and rank 0
SIGKILLs DCP's checkpoint daemon between saves (issue 12 item 3).

usage: daemon_worker.py ROOT    (under launch.py: RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Prints one JSON line ``EVENTS [...]`` with every on_event record (tensors excluded), then
``MODE <async_mode>`` and ``RESTORED <step> <value>``. The ``__main__`` guard matters: DCP's
daemon is a spawned process that re-imports this file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.torch_private import checkpoint_daemon


def _kill_daemon() -> None:
    pid, code = checkpoint_daemon() or (None, None)
    assert pid is not None and code is None, "rank 0 should have a live daemon by now"
    os.kill(pid, signal.SIGKILL)
    while (checkpoint_daemon() or (0, None))[1] is None:  # until the kill has landed
        time.sleep(0.01)


def main() -> None:
    root = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(32, 32)
    events: list[dict] = []
    ckpt = Checkpointer(
        root, every_steps=1, keep_last=2, async_mode="process", on_event=events.append
    )
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        if step in (2, 3) and rank == 0:
            _kill_daemon()  # killed between saves: DCP would answer BrokenPipeError forever
        dist.barrier()  # every rank starts the save after the kill
        ckpt.maybe_save(step, {"model": model})
        ckpt.wait()
    mode = ckpt.async_mode
    ckpt.close()
    print("EVENTS " + json.dumps(events), flush=True)
    print(f"MODE {mode}", flush=True)
    fresh = nn.Linear(32, 32)
    step = Checkpointer(root, async_mode="sync").restore_latest({"model": fresh})
    print(f"RESTORED {step} {float(fresh.weight[0, 0])}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
