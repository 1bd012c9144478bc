"""steadytrain inside a Hugging Face Transformers + Accelerate training job.

A tiny random-init Llama (``LlamaConfig``, no hub access) trained by Accelerate on CPU, with
steadytrain's ``TokenLoader`` (data) and ``Run`` (async DCP checkpoints with automatic
resume and a final save, the goodput ledger, the hang watchdog, crash and restart
accounting: what ``steadytrain train`` gets)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # torchrun restarts (pytorch#135712)
    torchrun --nproc-per-node 2 --max-restarts 1 examples/hf_accelerate.py \\
        --data DATASET --run-dir runs/hf --steps 12 [--crash-at-step 7]

``--crash-at-step N`` SIGKILLs rank 1 in the middle of step N on the first attempt; torchrun
restarts both ranks, ``Run`` resumes from the newest committed checkpoint, and the run ends
with the same per-step losses and weights as one that never crashed. ``steadytrain report
RUN_DIR`` then shows the crash, the restart gap and the start-up of each attempt.

Three things to get right with Transformers and Accelerate:
- labels: HF causal-LM models shift the labels inside their loss, so the loader hands out
  ``labels == input_ids`` (``labels="same"``, the default). Shifted labels would train on
  token t+2 without any error.
- the loader is NOT given to ``accelerator.prepare``: it already reads only this rank's
  slice of every global batch, and Accelerate would shard it a second time.
- ``prepare`` wraps the model in DDP and the optimizer in ``AcceleratedOptimizer``: the
  checkpoint holds the unwrapped model and the inner optimizer, so it loads into either.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain import Run, TokenDataset, TokenLoader


class TrainState:
    """The step counter, checkpointed next to the model (any object with state_dict)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


def weights_sha256(model: torch.nn.Module) -> str:
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

    accelerator = Accelerator(cpu=True)  # under torchrun: a gloo process group, DDP
    rank, world = accelerator.process_index, accelerator.num_processes
    ds = TokenDataset.open(args.data)
    loader = TokenLoader(
        ds, seq_len=64, global_batch=8, micro_batch=2, rank=rank, world_size=world, seed=0
    )  # labels="same": the model shifts
    torch.manual_seed(0)  # the same initial weights on every rank and every attempt
    config = LlamaConfig(
        vocab_size=ds.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    raw_model = LlamaForCausalLM(config)
    raw_optim = torch.optim.AdamW(raw_model.parameters(), lr=3e-3, foreach=False)
    model, optim = accelerator.prepare(raw_model, raw_optim)

    state = TrainState()
    states = {
        "model": accelerator.unwrap_model(model),
        "optim": raw_optim,
        "loader": loader,
        "train": state,
    }
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
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                    accelerator.backward(loss / loader.micro_per_step)
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
    accelerator.end_training()


if __name__ == "__main__":
    main()
