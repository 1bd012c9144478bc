"""What one in-process snapshot of ``Recovery`` blocks the step for (issue 44 section 2).

    python bench/inplace_snapshot_cost.py [--layers 12] [--rounds 6]

A ~50M-parameter MLP (12 x Linear(2048, 2048)) with AdamW state: ~600 MB of model and
optimizer, one intra-op thread. Each round snapshots it two ways: ``copy.deepcopy`` of
the state dicts (fresh memory every time) and ``recovery.copy_state`` with two snapshots
kept (the evicted one's tensors take the copy). Seconds per snapshot, every round; the
first rounds of each pay first-touch page faults (NOTES-environment: up to 4.5 s/GB when
the balloon took the memory back).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from steadytrain.inplace.recovery import copy_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(args.layers)])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2048)).sum().backward()
    optim.step()

    def live() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    deep, reused, kept = [], [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        copy.deepcopy(live())
        deep.append(time.perf_counter() - t)
        evicted = kept.pop(0) if len(kept) >= 2 else None
        t = time.perf_counter()
        kept.append(copy_state(live(), evicted))
        reused.append(time.perf_counter() - t)
    mb = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6
    print(json.dumps({
        "state_mb": round(mb),
        "deepcopy_s": [round(x, 3) for x in deep],
        "copy_state_s": [round(x, 3) for x in reused],
        "median_last_half": {
            "deepcopy_s": round(statistics.median(deep[args.rounds // 2:]), 3),
            "copy_state_s": round(statistics.median(reused[args.rounds // 2:]), 3),
        },
    }))  # fmt: skip


if __name__ == "__main__":
    main()
