"""steadytrain inside Hugging Face ``Trainer``: ``SteadytrainCallback``.

The Trainer keeps its loop, its checkpoints (``OUTPUT_DIR/checkpoint-STEP``) and its
``resume_from_checkpoint``; the callback adds what ``steadytrain train`` records: the
goodput ledger, the hang watchdog, crash and restart accounting, ``steadytrain report``::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/hf_trainer_callback.py \\
        --data DATASET --run-dir runs/hft --steps 12 [--crash-at-step 7]
    steadytrain report runs/hft

A tiny random-init Llama (``LlamaConfig``, no hub access) on CPU. ``--crash-at-step N``
SIGKILLs rank 1 at the start of step N on the first attempt: rank 0 dies of the broken
all-reduce (the callback records that exception as the crash), torchrun restarts both, the
Trainer resumes from its newest checkpoint and finishes; the report shows the crash, the
restart gap and the steps of both attempts.

The data: ``TokenWindows``, the samples of a steadytrain dataset (``--seq-len`` tokens of a
shard each) as a map-style torch ``Dataset``, so the Trainer's own sampler batches, shards
and resumes them (labels are the inputs: HF causal-LM models shift them inside their loss).
A ``TokenLoader``'s micro-batches are not for the Trainer: it would batch them again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from steadytrain import TokenDataset, TokenWindows
from steadytrain.integrations.hf import SteadytrainCallback


class CrashAt(TrainerCallback):
    """SIGKILL rank 1 at the start of step ``step`` (first attempt only): a crash."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and args.process_index == 1 and state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a steadytrain dataset (path or URL)")
    p.add_argument("--run-dir", required=True, help="the ledger; the Trainer's output below")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)

    ds = TokenDataset.open(args.data)
    train_set = TokenWindows(ds, args.seq_len)  # labels = input_ids: the model shifts
    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_steps=4,
        save_total_limit=2,
        use_cpu=True,  # under torchrun: gloo
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ds.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(config)
    # One optimizer step's tokens over all ranks: batch x accumulation x ranks x length.
    tokens = 2 * 2 * targs.world_size * args.seq_len
    callbacks: list[TrainerCallback] = [SteadytrainCallback(args.run_dir, tokens_per_step=tokens)]
    if args.crash_at_step:
        callbacks.append(CrashAt(args.crash_at_step))
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, callbacks=callbacks)
    # The Trainer's own resume: its newest checkpoint (None on a fresh start). Every rank
    # looks, and only rank 0 creates output_dir: make sure it exists before listing it.
    os.makedirs(targs.output_dir, exist_ok=True)
    trainer.train(resume_from_checkpoint=get_last_checkpoint(targs.output_dir))
    if trainer.is_world_process_zero():
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main()
