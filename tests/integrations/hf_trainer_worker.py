"""One process (no torchrun) training examples/hf_trainer_callback.py's tiny Llama with
``SteadytrainCallback``, failing at step ``--at`` in the way ``--fail`` names:

- ``raise``: an exception out of ``Trainer.train`` (which calls no callback for it);
- ``sigterm``: SIGTERM to itself (torchrun stopping survivors, preemption);
- ``hang``: the step never ends (the watchdog's deadlines are shortened by ``--floor``).

Usage: python hf_trainer_worker.py DATASET RUN_DIR --fail raise|sigterm|hang [--at 3]
"""

from __future__ import annotations

import argparse
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
    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer"),
        max_steps=8,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_steps=100,
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
    cb = SteadytrainCallback(args.run_dir, tokens_per_step=64, monitor={"watchdog": watchdog})
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=targs,
        train_dataset=TokenWindows(ds, 32),
        callbacks=[cb, Fail(args.fail, args.at)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
