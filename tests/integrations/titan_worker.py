"""One rank of the torchtitan boundary test (launched by ``tests/distributed/checkpoint/launch.py``).

``save DATA FOLDER OUT``: build ``SteadyTitanDataLoader`` through torchtitan's own
``Config.build`` with the arguments its trainer passes, take 3 steps of batches, save through
torchtitan's real ``CheckpointManager`` (DCP), then record the inputs of steps 4 and 5.
``load DATA FOLDER OUT``: a fresh loader and manager on this world size load step 3 and
record steps 4 and 5. ``OUT-rankR.json`` holds, per step, this rank's input rows.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan_adapter import SteadyTitanDataLoader, titan_run  # noqa: E402

SEQ, LOCAL, GLOBAL, SAVED_AT = 64, 2, 8, 3


class Counter:
    """Stands in for the optimizer and LR-scheduler containers: any ``Stateful`` goes."""

    def __init__(self) -> None:
        self.n = torch.zeros(1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.n.copy_(sd["n"])


def main() -> None:
    mode, data, folder, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = SteadyTitanDataLoader.Config(dataset_path=data, global_batch=GLOBAL)
    dl = cfg.build(
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=None,
        seq_len=SEQ,
        local_batch_size=LOCAL,
        snapshot_every_n_steps=1,
    )
    manager = CheckpointManager.Config(
        enable=True, folder=folder, interval=1, last_save_model_only=False
    ).build(
        dataloader=dl,
        model_parts=[torch.nn.Linear(4, 4)],
        optimizers=Counter(),
        lr_schedulers=Counter(),
        states={"train_state": Counter()},
        sd_adapter=None,
    )
    batches = iter(dl)
    per_step = GLOBAL // world // LOCAL  # micro-batches per step on this rank
    if mode == "save":
        for _ in range(SAVED_AT * per_step):
            next(batches)
        manager.save(curr_step=SAVED_AT)
    else:
        assert manager.load(step=SAVED_AT), f"no checkpoint of step {SAVED_AT} in {folder}"
    steps = {}
    # steadytrain's ledger and watchdog beside torchtitan's checkpoints (out-run/ledger.jsonl)
    run_dir = f"{out}-run"
    with titan_run(run_dir, SAVED_AT, rank=rank, world_size=world, total_steps=SAVED_AT + 2) as run:
        for step in (SAVED_AT + 1, SAVED_AT + 2):
            rows = []
            for _ in range(per_step):
                with run.data_wait():
                    inputs, labels = next(batches)
                x = inputs["input"]
                # next-token labels: torchtitan's loss does not shift
                assert torch.equal(labels[:, :-1], x[:, 1:]), "labels are not the next tokens"
                rows += x.tolist()
            steps[step] = rows
            run.step_done(step, tokens=GLOBAL * SEQ)
    with open(f"{out}-rank{rank}.json", "w") as f:
        json.dump(steps, f)
    manager.close()
    dl.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
