"""One rank of the node-local retention test: each rank stages into its own directory (as
on separate nodes), checkpoints go to a shared remote, COMMIT exists locally only on rank 0.

usage: node_retention_worker.py ROOT STEPS KEEP_LAST
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.checkpoint import Checkpointer


def main() -> None:
    root, steps, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    ckpt = Checkpointer(
        os.path.join(root, f"node{rank}"),
        every_steps=1,
        keep_last=keep,
        async_mode="thread",
        remote="file://" + os.path.join(root, "remote"),
    )
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.maybe_save(step, {"model": model})
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
