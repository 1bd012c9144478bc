"""One rank of test_run_final_save_peer.py: 3 steps under ``steadytrain.Run`` on a 2-rank
gloo group; with ``--peer-dies``, rank 1 SIGKILLs itself after the last step, so rank 0's
final save finds its peer gone. Prints ``EXIT ok`` or ``EXIT <exception>``."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

from steadytrain import Run


def main() -> int:
    run_dir, peer_dies = sys.argv[1], "--peer-dies" in sys.argv
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        # no save before the final one: its failure is the only sign of the lost peer
        with Run(run_dir, {"model": model, "optim": optim}, rank=rank, world_size=2,
                 checkpoint={"every_steps": 1000}) as run:  # fmt: skip
            for step in range(1, 4):
                model(torch.ones(1, 64)).sum().backward()
                optim.step()
                run.step_done(step, tokens=64)
            dist.barrier()  # both ranks finished the last step
            if peer_dies and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"EXIT {type(exc).__name__}: {exc}", flush=True)
        return 1
    print("EXIT ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
