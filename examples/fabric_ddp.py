"""steadytrain inside a Lightning Fabric training job (not named ``lightning_fabric.py``: run
as a script, that name would shadow the package it imports).

Fabric (``strategy="ddp"``, ``accelerator="cpu"``, ``devices=2``) trains a tiny causal
transformer with steadytrain's ``TokenLoader`` and ``Run`` (async DCP
checkpoints, automatic resume, the goodput ledger). torchrun launches the processes, not Fabric: Fabric
detects torchrun's environment and joins it, and torchrun restarts the ranks after a crash
(Fabric's own launcher does not restart). ``Run`` gives the loop what ``steadytrain train``
has: the checkpointer, the goodput ledger, the hang watchdog, crash and restart accounting
and the final save::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/fabric_ddp.py \\
        --data DATASET --run-dir runs/fabric --steps 12 [--crash-at-step 7]

``--crash-at-step N`` SIGKILLs rank 1 in the middle of step N on the first attempt; the
restarted ranks resume from the newest committed checkpoint and end bit-identical to a run
that never crashed.

The model here does not shift its labels, so the loader hands out next-token labels
(``labels="next"``); a Hugging Face causal LM would need the default ``labels="same"``.
``fabric.setup`` wraps the model and optimizer: the checkpoint holds the objects created
before it, so it loads without Fabric too. The loader is not passed to
``fabric.setup_dataloaders``: it already reads only this rank's slice of each global batch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch import nn

from steadytrain import Run, TokenDataset, TokenLoader


class TinyLM(nn.Module):
    """Two causal transformer layers: predicts the token after each input token."""

    def __init__(self, vocab: int, seq_len: int, d: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


class TrainState:
    """The step counter, checkpointed next to the model (any object with state_dict)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a steadytrain dataset (path or URL)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)  # bit-exact resume on CPU

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()  # under torchrun: joins its processes, initialises gloo
    rank, world = fabric.global_rank, fabric.world_size
    ds = TokenDataset.open(args.data)
    loader = TokenLoader(
        ds,
        seq_len=64,
        global_batch=8,
        micro_batch=2,
        rank=rank,
        world_size=world,
        seed=0,
        labels="next",
    )  # TinyLM does not shift
    torch.manual_seed(0)  # the same initial weights on every rank and every attempt
    raw_model = TinyLM(ds.vocab_size, 64)
    raw_optim = torch.optim.AdamW(raw_model.parameters(), lr=3e-3, foreach=False)
    model, optim = fabric.setup(raw_model, raw_optim)

    state = TrainState()
    states = {"model": raw_model, "optim": raw_optim, "loader": loader, "train": state}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    checkpoint = {"every_steps": 4, "keep_last": 2, "async_mode": "thread"}
    with Run(
        args.run_dir,
        states,
        rank=rank,
        world_size=world,
        total_steps=args.steps,
        checkpoint=checkpoint,
        checkpoint_dir=os.path.join(args.run_dir, "ckpt"),
    ) as run:
        step = run.start_step  # restored: 0 when there is no checkpoint yet
        losses = open(os.path.join(args.run_dir, f"losses-attempt{attempt}.jsonl"), "a")
        model.train()
        while step < args.steps:
            per_micro = []
            for micro in range(loader.micro_per_step):  # gradient accumulation
                with run.data_wait():
                    batch = next(loader)
                last = micro == loader.micro_per_step - 1
                # DDP all-reduces the gradients once per step, on the last micro-batch
                with fabric.no_backward_sync(model, enabled=not last):
                    logits = model(batch["input_ids"])
                    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
                    fabric.backward(loss / loader.micro_per_step)
                per_micro.append(loss.detach())
            if step + 1 == args.crash_at_step and attempt == 0 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-step, before the update
            optim.step()
            optim.zero_grad(set_to_none=True)
            step = state.step = step + 1
            mean = torch.stack(per_micro).mean()
            dist.all_reduce(mean)
            run.step_done(step, tokens=8 * 64, loss=mean / world, loader=loader)
            if rank == 0:
                losses.write(json.dumps({"step": step, "loss": (mean / world).item()}) + "\n")
                losses.flush()
    # Run's exit committed the last step and closed the ledger (or recorded the crash)
    if rank == 0:
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": step, "weights": weights_sha256(raw_model)}, f)
    loader.close()
    fabric.barrier()


if __name__ == "__main__":
    main()
