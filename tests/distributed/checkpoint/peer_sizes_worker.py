"""Two ranks: memory-tier peer transfers whose sizes are not the agreed ones
(tests/distributed/test_memory_tier.py). usage: peer_sizes_worker.py OUT (RANK, WORLD_SIZE,
MASTER_* set by launch.py). Writes OUT/rankR.json: what each transfer gave and said.

- a generation's exchange: rank 0's image is 200 bytes where the all-gather agreed 100 (a
  copy that changed after the agreement); rank 1's is its agreed 64;
- a restore's transfer: rank 1 holds rank 0's copy, planned at 100 bytes, and the file is
  now 300 (replaced since the scan).

After both, one all-reduce on the same group: it must still work.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from steadytrain.checkpoint.memory import peers


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo")
    result: dict = {}

    image = np.full(200 if rank == 0 else 64, rank + 1, np.uint8)
    problems: list[str] = []
    got = peers.exchange(pg, 1 - rank, image, [1 - rank], sizes=[100, 64], problems=problems)
    result["exchange"] = {
        "got": {str(o): [len(b), int(b.sum())] for o, b in got.items()},
        "problems": problems,
    }

    if rank == 1:
        t = peers.Transfer(pg, [(0, np.full(300, 9, np.uint8), 100)], None)
    else:
        t = peers.Transfer(pg, [], (1, 100))
    t.wait()
    got_t = t.received
    result["transfer"] = {
        "received": None if got_t is None else [len(got_t), int(got_t.sum())],
        "problems": t.problems,
    }

    x = torch.tensor([rank + 1])
    dist.all_reduce(x, group=pg)
    result["after"] = int(x.item())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
