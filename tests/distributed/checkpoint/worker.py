"""One rank of a multi-process checkpoint test (launched by tests/distributed/test_checkpoint_*.py).

usage: worker.py save|load KIND:MODE[,KIND:MODE] DIR REF  with RANK/WORLD_SIZE/MASTER_* set;
KIND is ddp or fsdp, MODE sync/thread/process (used when saving). Each kind uses DIR/KIND.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.state import derive_seed


class Loader:
    """Stands in for TokenLoader: a JSON state of a few integers."""

    def __init__(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": 7}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


def build(kind: str):
    torch.manual_seed(1234)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6))
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def full_state(model, optim) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
    }


def main() -> None:
    action, specs, directory, ref = sys.argv[1:5]
    dist.init_process_group("gloo")
    for spec in specs.split(","):
        kind, mode = spec.split(":")
        run(action, kind, mode, os.path.join(directory, kind), f"{ref}.{kind}")
    dist.barrier()
    dist.destroy_process_group()


def run(action: str, kind: str, mode: str, directory: str, ref: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, sched = build(kind)
    loader = Loader()
    states = {"model": model, "optim": optim, "sched": sched, "loader": loader}
    events: list[dict] = []
    ckpt = Checkpointer(directory, every_steps=2, async_mode=mode, on_event=events.append)
    if action == "save":
        g = torch.Generator().manual_seed(rank)
        for step in range(1, 5):
            x = torch.randn(8, 12, generator=g)
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            sched.step()
            loader.cursor = step * 16
            ckpt.maybe_save(step, states, tokens_seen=step * 1000)
        ckpt.close()
        assert [e["ok"] for e in events] == [True, True], events
        # DDP's second save repeats the first one's plan (repeat_save.py); FSDP2's DTensor
        # shards are planned by DCP every save, and so is everything in process mode.
        reuse = kind == "ddp" and mode != "process"
        assert [e["plan"] for e in events] == ["dcp", "reused" if reuse else "dcp"], events
        full = full_state(model, optim)
        after = torch.rand(4)  # what this rank's restored RNG must produce next
        torch.save({"full": full, "rng": after}, f"{ref}.rank{rank}")
    else:
        step = ckpt.restore_latest(states)
        assert step == 4, (step, events)
        assert loader.cursor == 64 and sched.last_epoch == 4
        assert ckpt.tokens_seen == 4000
        full = full_state(model, optim)
        nxt = torch.rand(4)
        saved = torch.load(f"{ref}.rank{min(rank, 1)}", weights_only=False)
        if rank < 2:
            assert torch.equal(nxt, saved["rng"]), "RNG not restored per rank"
        else:
            torch.manual_seed(derive_seed(4, rank))
            assert torch.equal(nxt, torch.rand(4)), "extra rank must get the derived seed"
        if rank == 0:
            for part in ("model", "optim"):
                a = torch.utils._pytree.tree_flatten(full[part])[0]
                b = torch.utils._pytree.tree_flatten(saved["full"][part])[0]
                assert len(a) == len(b), part
                for x, y in zip(a, b, strict=True):
                    if isinstance(x, torch.Tensor):
                        assert torch.equal(x, y), f"{part} differs after reload on {world} ranks"
                    else:
                        assert x == y, (part, x, y)
        ckpt.close()
    print(f"rank {rank}/{world} {action} {kind} ok", flush=True)


if __name__ == "__main__":
    main()
