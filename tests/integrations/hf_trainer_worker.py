"""One process (no torchrun) training examples/hf_trainer_callback.py's tiny Llama with
``SteadytrainCallback``, failing at step ``--at`` in the way ``--fail`` names:

- ``raise``: an exception out of ``Trainer.train`` (which calls no callback for it);
- ``sigterm``: SIGTERM to itself (torchrun stopping survivors, preemption);
- ``hang``: the step never ends (the watchdog's deadlines are shortened by ``--floor``);
- ``none``: nothing fails; with ``--eval steps|epoch`` the Trainer evaluates every 4 steps
  (on an 8-sample training set, i.e. at each epoch's end, for ``epoch``), each evaluation
  taking ``--eval-s`` seconds, and saves every 4 steps too (so each evaluation falls on a
  save step: right before the save for ``steps``, right after it for ``epoch``); its
  ``log_history`` goes to RUN_DIR/log_history.json.

Usage: python hf_trainer_worker.py DATASET RUN_DIR --fail raise|sigterm|hang|none [--at 3]
           [--eval steps|epoch --eval-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from steadytrain import TokenDataset, TokenWindows
from steadytrain.integrations.hf import SteadytrainCallback


class Fail(TrainerCallback):
    def __init__(self, how: str, at: int) -> None:
        self.how, self.at = how, at

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        if state.global_step + 1 != self.at:
            return
        if self.how == "raise":
            raise ValueError(f"injected failure at step {self.at}")
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises inside this sleep
        if self.how == "hang":
            time.sleep(600)  # the watchdog ends the process long before


class SlowEval(TrainerCallback):
    """An evaluation of ``seconds`` in all: each of its ``batches`` takes its share."""

    def __init__(self, seconds: float, batches: int) -> None:
        self.each = seconds / batches

    def on_prediction_step(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        time.sleep(self.each)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("run_dir")
    p.add_argument("--fail", choices=["raise", "sigterm", "hang", "none"], required=True)
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--floor", type=float, default=2.0, help="watchdog deadlines (s)")
    p.add_argument("--eval", choices=["no", "steps", "epoch"], default="no")
    p.add_argument("--eval-s", type=float, default=0.0, help="seconds per evaluation")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = TokenDataset.open(args.data)
    windows = TokenWindows(ds, 32)
    evaluating = args.eval != "no"
    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer"),
        max_steps=8,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        logging_steps=1,
        save_steps=4 if evaluating else 100,
        eval_strategy=args.eval,
        eval_steps=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ds.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    f = args.floor
    watchdog = {"floor_s": f, "init_s": f, "checkpoint_s": f, "poll_s": 0.2, "grace_s": 1.0}
    callbacks = [Fail(args.fail, args.at)]
    if evaluating:  # its own deadline, longer than the step's and the checkpoint's
        watchdog["phases"] = {"eval_s": 5 * f}
        # What these runs test is the step deadline (f) an evaluation outlasts; start-up and
        # the saves get room, so a loaded machine's slow first step is no hang here.
        watchdog.update(init_s=60.0, checkpoint_s=30.0)
        callbacks.append(SlowEval(args.eval_s, batches=2))
    cb = SteadytrainCallback(args.run_dir, tokens_per_step=64, monitor={"watchdog": watchdog})
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=targs,
        # 8 samples: 4 steps an epoch, so "epoch" evaluates at steps 4 and 8 like "steps"
        train_dataset=torch.utils.data.Subset(windows, range(8)) if evaluating else windows,
        eval_dataset=torch.utils.data.Subset(windows, range(4)) if evaluating else None,
        callbacks=[cb, *callbacks],
    )
    trainer.train()
    with open(os.path.join(args.run_dir, "log_history.json"), "w") as out:
        json.dump(trainer.state.log_history, out)


if __name__ == "__main__":
    main()
