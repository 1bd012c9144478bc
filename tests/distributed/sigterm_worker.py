"""A gloo loop on ``steadytrain.Run`` whose every step is an all-reduce, for SIGTERM tests
(``test_sigterm_stuck.py``) and the teardown measurements of docs/operations.md. Started
with torchrun's environment (by torchrun, or by the test by hand).
``argv``: RUN_DIR SIGTERM_EXIT_S [deadlock]

``deadlock``: at step 5 ranks 0 and 1 each wait to receive from the other (a mismatched
collective, both inside a C++ call for good) and rank 2, when there is one, fails a second
later: the launcher then stops ranks that Python's SIGTERM handler cannot reach."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from steadytrain import Run

DEADLOCK_STEP = 5

run_dir, exit_s = sys.argv[1], float(sys.argv[2])
deadlock = sys.argv[3:] == ["deadlock"]
dist.init_process_group("gloo")
rank = dist.get_rank()
monitor = {"sigterm_exit_s": exit_s, "flush_interval_s": 0.05}
with Run(run_dir, {}, checkpoint=False, monitor=monitor) as run:
    step = run.start_step
    while True:
        t = torch.ones(4)
        if deadlock and step + 1 == DEADLOCK_STEP:
            if rank < 2:
                dist.recv(t, src=1 - rank)  # both wait for the other: never returns
            time.sleep(1.0)
            raise RuntimeError("rank 2 fails while ranks 0 and 1 are deadlocked")
        dist.all_reduce(t)  # blocks here once the peer is stopped
        step += 1
        run.step_done(step, tokens=8)
        time.sleep(0.02)
