"""steadytrain inside a Lightning ``Trainer``: ``SteadytrainCallback``.

Lightning keeps its loop, its ``ModelCheckpoint`` and ``fit(ckpt_path=...)``; the callback
adds what ``steadytrain train`` records: the goodput ledger, the hang watchdog, crash and
restart accounting, ``steadytrain report``::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/lightning_callback.py \\
        --data DATASET --run-dir runs/pl --steps 12 [--crash-at-step 7]
    steadytrain report runs/pl

A tiny next-token model on CPU (DDP, gloo). ``--crash-at-step N`` SIGKILLs rank 1 at the
start of step N on the first attempt: rank 0 dies of the broken all-reduce (Lightning
calls the callback's ``on_exception``: the crash), torchrun restarts both, Lightning
resumes from ``last.ckpt`` and finishes; the report shows the crash, the restart gap and
the steps of both attempts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from steadytrain import TokenDataset
from steadytrain.integrations.lightning import SteadytrainCallback


class Windows(torch.utils.data.Dataset):
    """Sample ``i``: tokens ``[i*L, (i+1)*L)`` of the dataset's shards, end to end."""

    def __init__(self, ds: TokenDataset, seq_len: int) -> None:
        tokens = np.concatenate([ds.tokens(s) for s in range(ds.num_shards)])
        n = len(tokens) // seq_len
        self.windows = torch.from_numpy(tokens[: n * seq_len].astype(np.int64)).view(n, -1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i]}


class TinyLM(L.LightningModule):
    """Embedding -> MLP -> vocabulary: predicts token t+1 from token t."""

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(vocab, dim), torch.nn.GELU(), torch.nn.Linear(dim, vocab)
        )

    def training_step(self, batch: dict[str, torch.Tensor], _idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.net(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


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
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    ds = TokenDataset.open(args.data)
    data = torch.utils.data.DataLoader(Windows(ds, args.seq_len), batch_size=2, shuffle=True)
    ckpt_dir = os.path.join(args.run_dir, "ckpt")
    saves = ModelCheckpoint(ckpt_dir, every_n_train_steps=4, save_top_k=-1, save_last=True)
    callbacks: list[Callback] = [saves, SteadytrainCallback(args.run_dir)]
    if args.crash_at_step:
        callbacks.append(CrashAt(args.crash_at_step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # torchrun's ranks
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        default_root_dir=args.run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = os.path.join(ckpt_dir, "last.ckpt")
    # Lightning's own resume: its newest checkpoint (None on a fresh start).
    trainer.fit(TinyLM(ds.vocab_size), data, ckpt_path=last if os.path.exists(last) else None)
    if trainer.is_global_zero:
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
