"""steadytrain inside Hugging Face ``Trainer``: its checkpoints go through steadytrain
(``SteadytrainTrainer``), or stay the Trainer's own with steadytrain's accounting beside them.

``--checkpoints steadytrain`` (the default): ``SteadytrainTrainer`` feeds the Trainer a
``TokenLoader`` (this rank's micro-batches, no sampler of the Trainer's), saves what
``save_strategy`` asks for through steadytrain's ``Checkpointer`` (sharded DCP in the
background, COMMIT, retention, the memory tier with ``--memory-every``), restores the newest
good recovery point in ``train()`` without ``resume_from_checkpoint``, resumes the loader
from its own state (no batch read twice) and records the run's ledger.
``--checkpoints hf``: the Trainer's own ``checkpoint-N`` folders and
``resume_from_checkpoint``, its own sampler over ``TokenWindows``, and ``SteadytrainCallback``
(the ledger)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/hf_trainer_callback.py \\
        --data DATASET --run-dir runs/hft --steps 12 [--crash-at-step 7 | --crash-in-save 8]
    steadytrain report runs/hft

A tiny random-init Llama (``LlamaConfig``, no hub access) on CPU. ``--crash-at-step N``
SIGKILLs rank 1 at the start of step N on the first attempt; ``--crash-in-save N`` SIGKILLs
rank 0 while the checkpoint of step N is written (steadytrain only). The other ranks die of
the broken all-reduce, torchrun restarts them all, the run resumes from its newest committed
checkpoint and finishes; the report shows the crash, the restart gap and the steps of both
attempts. With steadytrain each rank writes ``RUN_DIR/trace-rank{R}.jsonl`` (every step's
logged loss and this rank's sample ids) and rank 0 ``RUN_DIR/final.json`` (the step, and
the weights' SHA-256): what the tests compare with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
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
from transformers.trainer_utils import get_last_checkpoint

from steadytrain import TokenDataset, TokenLoader, TokenWindows
from steadytrain.integrations.hf import SteadytrainCallback
from steadytrain.integrations.hf_steady import SteadytrainTrainer
from steadytrain.testing.trainer_faults import first_attempt, kill_before_commit


class CrashAt(TrainerCallback):
    """SIGKILL rank 1 at the start of step ``step`` (first attempt only): a crash; or, with
    ``in_save``, rank 0 while the checkpoint of ``step`` is written (before its COMMIT)."""

    def __init__(self, step: int, in_save: bool = False) -> None:
        self.step, self.in_save, self.steady = step, in_save, None

    def on_train_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        if self.in_save and args.process_index == 0:
            kill_before_commit(self.steady.run.checkpointer, self.step)

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        mine = not self.in_save and args.process_index == 1
        if first_attempt() and mine and state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Pace(TrainerCallback):
    """``--step-sleep S``: S seconds after each step, so a job of tiny steps lasts long
    enough for something outside it (a test's kill) to land mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        time.sleep(self.seconds)


class Trace(TrainerCallback):
    """``RUN_DIR/trace-rank{R}.jsonl``: each step's logged loss (the mean over ranks) and this
    rank's sample ids (``trainer.steady.sample_ids``), per attempt."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir, self.steady = run_dir, None

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # noqa: ANN001
        if "loss" not in (logs or {}):
            return
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        node = os.environ.get("STEADYTRAIN_NODE") or platform.node()
        # the Run's attempt id: the same on every rank, a spare's (restart count 0) too
        rec = {"step": state.global_step, "attempt": count, "node": node}
        rec |= {"attempt_id": self.steady.run.attempt_id, "rank": args.process_index}
        rec |= {"world": args.world_size, "loss": logs["loss"]}
        rec["sample_ids"] = list(self.steady.sample_ids)
        with open(os.path.join(self.run_dir, f"trace-rank{args.process_index}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def tiny_config(vocab: int, seq_len: int) -> LlamaConfig:
    """The tiny random-init Llama's config (``from_pretrained`` of an export needs it)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
    )


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a steadytrain dataset (path or URL)")
    p.add_argument("--run-dir", required=True, help="the ledger; the Trainer's output below")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--checkpoints", choices=["steadytrain", "hf"], default="steadytrain")
    p.add_argument("--save-every", type=int, default=4, help="save_steps")
    p.add_argument("--memory-every", type=int, default=0, help="memory-tier snapshots (steps)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
    p.add_argument("--crash-at-step", type=int, default=0, help="first attempt only")
    p.add_argument("--crash-in-save", type=int, default=0, help="first attempt only")
    args = p.parse_args()
    torch.set_num_threads(1)

    ds = TokenDataset.open(args.data)
    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_steps=args.save_every,
        save_total_limit=2,
        use_cpu=True,  # under torchrun: gloo
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(ds.vocab_size, args.seq_len))
    # One optimizer step's tokens over all ranks: batch x accumulation x ranks x length.
    tokens = 2 * 2 * targs.world_size * args.seq_len
    crash = args.crash_at_step or args.crash_in_save
    callbacks: list[TrainerCallback] = [CrashAt(crash, args.crash_in_save > 0)] if crash else []
    if args.step_sleep > 0:
        callbacks.append(Pace(args.step_sleep))
    if args.checkpoints == "steadytrain":
        # This rank's micro-batches, labels = input_ids (HF causal-LM models shift inside).
        loader = TokenLoader(
            ds, seq_len=args.seq_len, global_batch=2 * 2 * targs.world_size, micro_batch=2,
            rank=targs.process_index, world_size=targs.world_size, seed=0,
        )  # fmt: skip
        trace = Trace(args.run_dir)
        trainer = SteadytrainTrainer(
            model=model,
            args=targs,
            loader=loader,
            run_dir=args.run_dir,
            checkpoint={"memory": {"every_steps": args.memory_every}},
            callbacks=[trace, *callbacks],
        )
        for cb in callbacks + [trace]:
            cb.steady = trainer.steady
        trainer.train()  # resumes by itself
        loader.close()
    else:  # the Trainer's own checkpoints and sampler; steadytrain's ledger beside them
        callbacks.append(SteadytrainCallback(args.run_dir, tokens_per_step=tokens))
        train_set = TokenWindows(ds, args.seq_len)  # samples: the Trainer batches them
        trainer = Trainer(model=model, args=targs, train_dataset=train_set, callbacks=callbacks)
        # Every rank looks, and only rank 0 creates output_dir: make sure it exists first.
        os.makedirs(targs.output_dir, exist_ok=True)
        trainer.train(resume_from_checkpoint=get_last_checkpoint(targs.output_dir))
    if trainer.is_world_process_zero():
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({"step": trainer.state.global_step, "weights": weights_sha256(model)}, f)


if __name__ == "__main__":
    main()
