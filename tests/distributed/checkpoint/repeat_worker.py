"""One rank of tests/distributed/test_checkpoint_repeat_save.py.

usage: repeat_worker.py DIR  with RANK/WORLD_SIZE/MASTER_* set. Saves four steps in thread
mode; at step 3 rank 1 alone gains a tensor, so its layout changes and no rank may reuse
the old plan; then every rank restores and checks what it gets back.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from steadytrain.checkpoint import Checkpointer


class Tensors:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def values(rank: int, step: int, late: bool) -> dict[str, torch.Tensor]:
    out = {
        f"own{rank}": torch.full((1000,), float(100 * rank + step)),  # this rank's alone
        "shared": torch.full((16,), float(step)),  # the same name on every rank: deduplicated
    }
    if late:
        out["late1"] = torch.full((7,), float(-step))
    return out


def main() -> None:
    directory = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = Tensors(values(rank, 0, False))
    events: list[dict] = []
    ckpt = Checkpointer(directory, every_steps=1, async_mode="thread", on_event=events.append)
    for step in (1, 2, 3, 4):
        late = rank == 1 and step >= 3
        for name, t in values(rank, step, late).items():
            if name in state.tensors:
                state.tensors[name].copy_(t)
            else:
                state.tensors[name] = t.clone()
        ckpt.maybe_save(step, {"state": state})
    ckpt.close()
    plans = [(e["plan"], e["ok"]) for e in events if e["type"] == "checkpoint"]
    want = [("dcp", True), ("reused", True), ("dcp", True), ("reused", True)]
    assert plans == want, (rank, plans)

    back = Tensors({k: torch.zeros_like(v) for k, v in state.tensors.items()})
    restored = Checkpointer(directory, verify="full").restore_latest({"state": back})
    assert restored == 4, restored
    for name, t in values(rank, 4, rank == 1).items():
        assert torch.equal(back.tensors[name], t), (rank, name)
    print(f"rank {rank} repeat ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
