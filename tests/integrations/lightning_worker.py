"""One process (no torchrun) training examples/lightning_callback.py's tiny model with
``SteadytrainCallback``, failing at step ``--at`` in the way ``--fail`` names:

- ``raise``: an exception in ``training_step`` (Lightning calls ``on_exception``);
- ``sigterm``: SIGTERM to itself (Lightning's handler, then its ``SIGTERMException``);
- ``hang``: the step never ends (the watchdog's deadlines are shortened by ``--floor``);
- ``setup``: an exception in the module's ``setup`` (before ``on_train_start``);
- ``escape``: as ``raise``, and a user callback's ``on_exception`` raises too, so the
  exception escapes Lightning's hooks before the strategy's ``on_exception`` and teardown
  (with ``--strategy``: the process leaves with the strategy's Run open);
- ``none``: nothing fails; with ``--val-s S`` Lightning validates every 4 steps, each
  validation taking S seconds, and their times go to RUN_DIR/validations.json. That run
  also accumulates 2 micro-batches a step and saves every 4 steps (``ModelCheckpoint``,
  on the steps it validates: the save first, then the validation), and the loss
  ``training_step`` logs at each step's last micro-batch goes to RUN_DIR/losses.json.

``--strategy``: steadytrain's ``SteadySingleDeviceStrategy`` (its own Run) instead of the
callback.

Usage: python lightning_worker.py DATASET RUN_DIR --fail raise|sigterm|hang|setup|escape|none
           [--at 3] [--val-s S] [--strategy]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning_callback import TinyLM  # noqa: E402

from steadytrain import TokenDataset, TokenWindows  # noqa: E402
from steadytrain.integrations.lightning import SteadytrainCallback  # noqa: E402


class Failing(TinyLM):
    def __init__(self, vocab: int, how: str, at: int, val_s: float = 0.0) -> None:
        super().__init__(vocab)
        self.how, self.at, self.val_s = how, at, val_s
        self.validations: list[dict[str, float]] = []
        self.logged: dict[int, float] = {}  # step -> the loss self.log got last in it

    def setup(self, stage: str) -> None:
        if self.how == "setup":
            raise ValueError("injected failure in setup")

    def validation_step(self, batch: dict[str, torch.Tensor], idx: int) -> None:
        time.sleep(self.val_s / VAL_BATCHES)  # a validation of val_s seconds in all

    def on_validation_start(self) -> None:
        self.validations.append({"step": self.trainer.global_step, "t0": time.monotonic()})

    def on_validation_end(self) -> None:
        self.validations[-1]["s"] = time.monotonic() - self.validations[-1].pop("t0")

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        if self.trainer.global_step + 1 == self.at:
            if self.how in ("raise", "escape"):
                raise ValueError(f"injected failure at step {self.at}")
            if self.how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning stops after this batch
            if self.how == "hang":
                time.sleep(600)  # the watchdog ends the process long before
        loss = super().training_step(batch, idx)
        self.log("train_loss", loss)
        self.logged[self.trainer.global_step + 1] = float(loss)  # the step it belongs to
        return loss


VAL_BATCHES = 2


class FailingOnException(L.Callback):
    """A user callback whose own ``on_exception`` fails (a logger whose server is gone)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exc: BaseException):
        raise RuntimeError("a user callback's on_exception failed")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("run_dir")
    fails = ["raise", "sigterm", "hang", "setup", "escape", "none"]
    p.add_argument("--fail", choices=fails, required=True)
    p.add_argument("--strategy", action="store_true", help="SteadySingleDeviceStrategy")
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--floor", type=float, default=2.0, help="watchdog deadlines (s)")
    p.add_argument("--val-s", type=float, default=0.0, help="seconds per validation")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = TokenDataset.open(args.data)
    f = args.floor
    watchdog = {"floor_s": f, "init_s": f, "checkpoint_s": f, "poll_s": 0.2, "grace_s": 1.0}
    windows = TokenWindows(ds, 32, labels="next")
    val: dict = {"limit_val_batches": 0, "enable_checkpointing": False}
    steady: dict = {}
    if args.strategy:
        from steadytrain.integrations.lightning_steady import SteadySingleDeviceStrategy

        steady["strategy"] = SteadySingleDeviceStrategy(
            args.run_dir, monitor={"watchdog": watchdog}
        )
        callbacks: list = []
    else:
        callbacks = [SteadytrainCallback(args.run_dir, monitor={"watchdog": watchdog})]
    if args.fail == "escape":
        callbacks.append(FailingOnException())
    if args.val_s:  # every 4 steps; its own deadline, longer than the step's and the save's
        watchdog["phases"] = {"eval_s": 5 * f}
        # What these runs test is the step deadline (f) an evaluation outlasts; start-up and
        # the saves get room, so a loaded machine's slow first step is no hang here.
        watchdog.update(init_s=60.0, checkpoint_s=30.0)
        # 2 micro-batches a step: every 8 batches is every 4 steps
        val = {"val_check_interval": 8, "limit_val_batches": VAL_BATCHES,
               "num_sanity_val_steps": 0, "accumulate_grad_batches": 2}  # fmt: skip
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.run_dir, "ckpt"), every_n_train_steps=4, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        **(steady or {"accelerator": "cpu", "devices": 1}),
        max_steps=8,
        callbacks=callbacks,
        default_root_dir=args.run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **val,
    )
    data = torch.utils.data.DataLoader(windows, batch_size=2)
    model = Failing(ds.vocab_size, args.fail, args.at, args.val_s)
    if args.val_s:
        held_out = torch.utils.data.Subset(windows, range(2 * VAL_BATCHES))
        trainer.fit(model, data, torch.utils.data.DataLoader(held_out, batch_size=2))
    else:
        trainer.fit(model, data)
    with open(os.path.join(args.run_dir, "validations.json"), "w") as out:
        json.dump(model.validations, out)
    with open(os.path.join(args.run_dir, "losses.json"), "w") as out:
        json.dump(model.logged, out)


if __name__ == "__main__":
    main()
