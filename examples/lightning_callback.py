"""steadytrain inside a Lightning ``Trainer``: its checkpoints go through steadytrain
(``SteadyDDPStrategy``), or stay Lightning's own with steadytrain's accounting beside them.

``--checkpoints steadytrain`` (the default): the strategy saves what ``ModelCheckpoint``
asks for through steadytrain's ``Checkpointer`` (sharded DCP in the background, COMMIT,
retention, the memory tier with ``--memory-every``), restores the newest good recovery
point at ``fit`` without a ``ckpt_path``, keeps the ``TokenLoader``'s position as of the last
batch trained on, and records the run's ledger (``steadytrain report``).
``--checkpoints lightning``: Lightning's ``ModelCheckpoint`` files and ``fit(ckpt_path=...)``,
with ``SteadytrainCallback`` (the ledger) and ``ExactResume(loader)`` (the loader's position in
Lightning's checkpoint). Either way a resumed run equals an uninterrupted one bit for bit::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/lightning_callback.py \\
        --data DATASET --run-dir runs/pl --steps 12 [--crash-at-step 7 | --crash-in-save 8]
    steadytrain report runs/pl

A tiny next-token model on CPU (DDP, gloo). ``--crash-at-step N`` SIGKILLs rank 1 at the
start of step N on the first attempt; ``--crash-in-save N`` SIGKILLs rank 0 while the
checkpoint of step N is written (its shards on disk, its COMMIT not: steadytrain only).
The other ranks die of the broken all-reduce, torchrun restarts them all, the run resumes
from its newest committed checkpoint and finishes; the report shows the crash, the restart
gap and the steps of both attempts. Each rank writes ``RUN_DIR/trace-rank{R}.jsonl`` (every
step's loss and sample ids) and rank 0 ``RUN_DIR/final.json`` (the weights' SHA-256): what
the tests compare with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from steadytrain import TokenDataset, TokenLoader
from steadytrain.integrations.lightning import ExactResume, SteadytrainCallback
from steadytrain.integrations.lightning_steady import SteadyDDPStrategy, SteadySingleDeviceStrategy
from steadytrain.testing.trainer_faults import first_attempt, kill_before_commit


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
        rank = trainer.global_rank
        rec = {"step": step, "rank": rank, "world": self.world, **attempt(trainer.strategy)}
        rec |= {"loss": float(outputs["loss"]), "sample_ids": self.ids}
        with open(os.path.join(self.run_dir, f"trace-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.ids = []


def attempt(strategy: Any) -> dict[str, Any]:
    """Which attempt and node a trace record is from: the steadytrain Run's attempt id (the
    same on every rank, also when a spare joins with its own restart count), else
    torchrun's restart count."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run = getattr(getattr(strategy, "steady", None), "run", None)
    node = os.environ.get("STEADYTRAIN_NODE") or platform.node()
    return {"attempt": count, "attempt_id": run.attempt_id if run else count, "node": node}


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Pace(Callback):
    """``--step-sleep S``: S seconds after each micro-batch, so a job of tiny steps lasts
    long enough for something outside it (a test's kill) to land mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:  # noqa: ANN001
        time.sleep(self.seconds)


class CrashAt(Callback):
    """SIGKILL rank 1 at the start of step ``step`` (first attempt only): a crash; or, with
    ``in_save``, rank 0 while the checkpoint of ``step`` is written (before its COMMIT)."""

    def __init__(self, step: int, in_save: bool = False) -> None:
        self.step, self.in_save = step, in_save

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self.in_save and trainer.global_rank == 0:
            kill_before_commit(trainer.strategy.steady.run.checkpointer, self.step)

    def on_train_batch_start(self, trainer, pl_module, batch, idx) -> None:  # noqa: ANN001
        mine = not self.in_save and trainer.global_rank == 1
        if first_attempt() and mine and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a steadytrain dataset (path or URL)")
    p.add_argument("--run-dir", required=True, help="the ledger; checkpoints below")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, all ranks")
    p.add_argument("--checkpoints", choices=["steadytrain", "lightning"], default="steadytrain")
    p.add_argument("--save-every", type=int, default=4, help="ModelCheckpoint's interval")
    p.add_argument("--memory-every", type=int, default=0, help="memory-tier snapshots (steps)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each batch")
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    p.add_argument("--crash-in-save", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and attempt
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's ranks on this node

    ds = TokenDataset.open(args.data)
    # This rank's slice of each global batch, next-token labels (TinyLM does not shift).
    loader = TokenLoader(
        ds, seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=2,
        rank=rank, world_size=world, seed=0, labels="next",
    )  # fmt: skip
    ckpt_dir = os.path.join(args.run_dir, "ckpt")
    saves = ModelCheckpoint(
        ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1, save_last=True
    )
    callbacks: list[Callback] = [saves, Trace(args.run_dir, world)]
    if args.checkpoints == "steadytrain":
        # ModelCheckpoint decides when; steadytrain saves, restores, keeps the loader's place.
        memory = {"every_steps": args.memory_every}
        steady = SteadyDDPStrategy if world > 1 else SteadySingleDeviceStrategy
        strategy: Any = steady(args.run_dir, loader=loader, checkpoint={"memory": memory})
    else:  # Lightning's own files and resume, steadytrain's ledger beside them
        callbacks += [SteadytrainCallback(args.run_dir), ExactResume(loader)]
        strategy = "ddp" if world > 1 else "auto"
    if args.step_sleep > 0:
        callbacks.append(Pace(args.step_sleep))
    if args.crash_at_step or args.crash_in_save:
        callbacks.append(CrashAt(args.crash_at_step or args.crash_in_save, args.crash_in_save > 0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=loader.micro_per_step,  # Lightning's steps are the loader's
        deterministic=True,  # bit-exact resume on CPU
        callbacks=callbacks,
        default_root_dir=args.run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyLM(ds.vocab_size)
    # A plain DataLoader: the loader's position is saved by steadytrain (module docstring).
    data = DataLoader(loader.as_dataset(), batch_size=None)
    if args.checkpoints == "steadytrain":
        trainer.fit(model, data)  # resumes by itself
    else:
        last = os.path.join(ckpt_dir, "last.ckpt")  # Lightning's newest (None: a fresh start)
        trainer.fit(model, data, ckpt_path=last if os.path.exists(last) else None)
    loader.close()
    if trainer.is_global_zero:
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": trainer.global_step, "weights": weights_sha256(model)}, f)


if __name__ == "__main__":
    main()
