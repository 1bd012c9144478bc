"""One process (no torchrun) training examples/lightning_callback.py's tiny model with
``SteadytrainCallback``, failing at step ``--at`` in the way ``--fail`` names:

- ``raise``: an exception in ``training_step`` (Lightning calls ``on_exception``);
- ``sigterm``: SIGTERM to itself (Lightning's handler, then its ``SIGTERMException``);
- ``hang``: the step never ends (the watchdog's deadlines are shortened by ``--floor``).

Usage: python lightning_worker.py DATASET RUN_DIR --fail raise|sigterm|hang [--at 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning_callback import TinyLM  # noqa: E402

from steadytrain import TokenDataset, TokenWindows  # noqa: E402
from steadytrain.integrations.lightning import SteadytrainCallback  # noqa: E402


class Failing(TinyLM):
    def __init__(self, vocab: int, how: str, at: int) -> None:
        super().__init__(vocab)
        self.how, self.at = how, at

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        if self.trainer.global_step + 1 == self.at:
            if self.how == "raise":
                raise ValueError(f"injected failure at step {self.at}")
            if self.how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning stops after this batch
            if self.how == "hang":
                time.sleep(600)  # the watchdog ends the process long before
        return super().training_step(batch, idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("run_dir")
    p.add_argument("--fail", choices=["raise", "sigterm", "hang"], required=True)
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--floor", type=float, default=2.0, help="watchdog deadlines (s)")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = TokenDataset.open(args.data)
    f = args.floor
    watchdog = {"floor_s": f, "init_s": f, "checkpoint_s": f, "poll_s": 0.2, "grace_s": 1.0}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        callbacks=[SteadytrainCallback(args.run_dir, monitor={"watchdog": watchdog})],
        default_root_dir=args.run_dir,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(TokenWindows(ds, 32, labels="next"), batch_size=2)
    trainer.fit(Failing(ds.vocab_size, args.fail, args.at), data)


if __name__ == "__main__":
    main()
