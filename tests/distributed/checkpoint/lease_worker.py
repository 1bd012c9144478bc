"""One training job for the writer-lease tests: saves a model whose every value says which
job and which step wrote it, then holds the root (sleeps until killed) or closes.

usage: lease_worker.py ROOT --base B [--steps N | --forever] [--hold] [--ready FILE]
       [--remote URL] [--timeout S]

``--ready FILE`` is created once the job holds the root (after its saves with ``--hold``,
after its first save with ``--forever``). Every tensor of step ``s`` holds ``B + s``, so a checkpoint mixing two jobs' files shows two
values. Exit status: 0 done (or killed while holding), 3 refused by the lease at the first
save, 4 stopped because another job took the lease. The message goes to stdout either way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.errors import CheckpointError


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--base", type=float, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--forever", action="store_true")
    p.add_argument("--hold", action="store_true")
    p.add_argument("--ready", default="")
    p.add_argument("--remote", default="")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    opts = json.loads(os.environ.get("LEASE_TEST_STORAGE_OPTIONS", "{}"))
    model = nn.Linear(64, 64)
    ckpt = Checkpointer(
        a.root,
        async_mode="sync",
        keep_last=3,
        remote=a.remote or None,
        storage_options=opts or None,
        lease_timeout_s=a.timeout,
    )
    steps = itertools.count(1) if a.forever else range(1, a.steps + 1)
    for step in steps:
        with torch.no_grad():
            for t in model.parameters():
                t.fill_(a.base + step)
        try:
            ckpt.save(step, {"model": model})
        except CheckpointError as exc:
            print(f"CHECKPOINT-ERROR at step {step}: {exc}", flush=True)
            return 3 if step == 1 else 4
        event = ckpt.last_event or {}
        print(f"saved {step} ok={event.get('ok')} {event.get('error') or ''}", flush=True)
        if a.forever:
            if a.ready and step == 1:
                open(a.ready, "w").close()
            time.sleep(0.05)
    if a.hold:
        print("holding", flush=True)
        if a.ready:
            open(a.ready, "w").close()
        while True:
            time.sleep(60)
    ckpt.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
