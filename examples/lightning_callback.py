"""steadytrain inside a Lightning ``Trainer``: ``SteadytrainCallback`` and ``ExactResume``.

Lightning keeps its loop, its ``ModelCheckpoint`` and ``fit(ckpt_path=...)``;
``SteadytrainCallback`` adds what ``steadytrain train`` records: the goodput ledger, the
hang watchdog, crash and restart accounting, ``steadytrain report``. The data is a
``TokenLoader`` (this rank's slice of each global batch) through a plain ``DataLoader``, and
``ExactResume(loader)`` keeps its position in Lightning's checkpoints as of the last batch
the model trained on (Lightning fetches one ahead) and DDP's gradient layout fixed, so a
resumed run equals an uninterrupted one bit for bit::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/lightning_callback.py \\
        --data DATASET --run-dir runs/pl --steps 12 [--crash-at-step 7]
    steadytrain report runs/pl

A tiny next-token model on CPU (DDP, gloo). ``--crash-at-step N`` SIGKILLs rank 1 at the
start of step N on the first attempt: rank 0 dies of the broken all-reduce (Lightning
calls the callback's ``on_exception``: the crash), torchrun restarts both, Lightning
resumes from ``last.ckpt`` and finishes; the report shows the crash, the restart gap and
the steps of both attempts. Each rank writes ``RUN_DIR/trace-rank{R}.jsonl`` (every step's
loss and sample ids) and rank 0 ``RUN_DIR/final.json`` (the weights' SHA-256): what the
test compares with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from steadytrain import TokenDataset, TokenLoader
from steadytrain.integrations.lightning import ExactResume, SteadytrainCallback


class TinyLM(L.LightningModule):
    """Embedding -> MLP -> vocabulary: predicts token t+1 from token t."""

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(vocab, dim), torch.nn.GELU(), torch.nn.Linear(dim, vocab)
        )

    def training_step(self, batch: dict[str, torch.Tensor], _idx: int) -> torch.Tensor:
        logits = self.net(batch["input_ids"])  # labels: the next tokens (labels="next")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Trace(Callback):
    """``RUN_DIR/trace-rank{R}.jsonl``: each step's loss (its last micro-batch's) and the
    sample ids of its micro-batches, per rank and attempt, for the exact-resume test."""

    def __init__(self, run_dir: str, world: int) -> None:
        self.run_dir, self.world, self.ids, self.step = run_dir, world, [], 0

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.step = trainer.global_step  # restored

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:  # noqa: ANN001
        self.ids += batch["sample_ids"].tolist()
        step = trainer.global_step
        if step == self.step:
            return  # a micro-batch of gradient accumulation: the step goes on
        self.step = step
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        rank = trainer.global_rank
        rec = {"step": step, "attempt": attempt, "attempt_id": attempt, "rank": rank}
        rec |= {"world": self.world, "loss": float(outputs["loss"]), "sample_ids": self.ids}
        with open(os.path.join(self.run_dir, f"trace-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.ids = []


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class CrashAt(Callback):
    """SIGKILL rank 1 at the start of step ``step`` (first attempt only): a crash."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, idx) -> None:  # noqa: ANN001
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and trainer.global_rank == 1 and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a steadytrain dataset (path or URL)")
    p.add_argument("--run-dir", required=True, help="the ledger; checkpoints below")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, all ranks")
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and attempt
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    ds = TokenDataset.open(args.data)
    # This rank's slice of each global batch, next-token labels (TinyLM does not shift).
    loader = TokenLoader(
        ds, seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=2,
        rank=rank, world_size=world, seed=0, labels="next",
    )  # fmt: skip
    ckpt_dir = os.path.join(args.run_dir, "ckpt")
    saves = ModelCheckpoint(ckpt_dir, every_n_train_steps=4, save_top_k=-1, save_last=True)
    callbacks: list[Callback] = [saves, SteadytrainCallback(args.run_dir), ExactResume(loader)]
    callbacks.append(Trace(args.run_dir, world))
    if args.crash_at_step:
        callbacks.append(CrashAt(args.crash_at_step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # torchrun's ranks
        strategy="ddp" if world > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=loader.micro_per_step,  # Lightning's steps are the loader's
        deterministic=True,  # bit-exact resume on CPU
        callbacks=callbacks,
        default_root_dir=args.run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = os.path.join(ckpt_dir, "last.ckpt")
    model = TinyLM(ds.vocab_size)
    # Lightning's own resume: its newest checkpoint (None on a fresh start). A plain
    # DataLoader: ExactResume holds the loader's position (module docstring).
    data = DataLoader(loader.as_dataset(), batch_size=None)
    trainer.fit(model, data, ckpt_path=last if os.path.exists(last) else None)
    loader.close()
    if trainer.is_global_zero:
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": trainer.global_step, "weights": weights_sha256(model)}, f)


if __name__ == "__main__":
    main()
