"""One rank of a real multi-process loader run over gloo (launched by test_loader_dist.py).

Each rank reads its slice of every step, the ranks all_gather their sample ids and input
ids, and rank 0 writes the assembled global batches to --out as JSON. With --restart-at K
every rank saves its loader state after step K, drops the loader and resumes a fresh one
from that state (what a restart from a checkpoint does).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader

BLOCK = {"block_size": 4, "window_blocks": 3}  # small, so windows matter at this size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--datasets", nargs="+", required=True)
    p.add_argument("--weights", nargs="*", type=float, default=None)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--shuffle", default="global")
    p.add_argument("--restart-at", type=int, default=-1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=a.rank, world_size=a.world)
    datasets = [TokenDataset.open(u) for u in a.datasets]

    def make() -> TokenLoader:
        return TokenLoader(
            datasets if len(datasets) > 1 else datasets[0],
            16,
            8,
            8 // a.world // 2 or 1,
            rank=a.rank,
            world_size=a.world,
            seed=11,
            shuffle=a.shuffle,
            weights=[int(w) for w in a.weights] if a.weights else None,
            shuffle_settings=BLOCK if a.shuffle == "block" else None,
        )

    loader = make()
    out = []
    for step in range(a.steps):
        parts = [next(loader) for _ in range(loader.micro_per_step)]
        ids = torch.cat([b["sample_ids"] for b in parts])
        inp = torch.cat([b["input_ids"] for b in parts])
        all_ids = [torch.empty_like(ids) for _ in range(a.world)]
        all_inp = [torch.empty_like(inp) for _ in range(a.world)]
        dist.all_gather(all_ids, ids)
        dist.all_gather(all_inp, inp)
        out.append({"ids": torch.cat(all_ids).tolist(), "inputs": torch.cat(all_inp).tolist()})
        if step == a.restart_at:
            state = json.loads(json.dumps(loader.state_dict()))
            loader.close()
            loader = make()
            loader.load_state_dict(state)
    loader.close()
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
