"""The reference training loop: a small GPT on a token-shard dataset, fault tolerant.

Read it top to bottom; it is one function on purpose. It wires the pieces together:
TokenDataset (+ node-local ShardCache when the data is remote) -> TokenLoader -> DDP/FSDP2
model -> AdamW with warm-up and cosine decay -> ``steadytrain.Run``, the public entry any
loop holds (steadytrain/run.py): the Checkpointer (async, sharded, COMMIT last), the
GoodputMeter (RUN_DIR/ledger.jsonl), the hang watchdog, start-up/restart/crash accounting and
the final save. This loop uses nothing of them that a user's loop cannot. Each component
takes its own table of the config as it is (``[data]``, ``[checkpoint]``, ``[monitor]``:
train/config.py). Every start, first or after a crash, restores the newest committed
checkpoint (``run.start_step``), so a job run under ``torchrun --max-restarts N`` recovers
without a human.

Restarts need a fresh rendezvous store per attempt (pytorch/pytorch#135712)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

One machine, 2 processes on CPU (gloo)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        -m steadytrain.cli train small --set data.dataset=/data/ds

Several machines (run on each; c10d rendezvous, elastic between 3 and 4 nodes: 24 or 32
ranks, so the global batch is a multiple of both x micro_batch; the start-up check knows
the range from ``train.elastic_nnodes``)::

    torchrun --nnodes 3:4 --nproc-per-node 8 --max-restarts 10 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id job42 \\
        -m steadytrain.cli train small --set data.dataset=s3://bucket/ds \\
        --set data.cache_dir=/nvme/steady-cache \\
        --set data.global_batch=768 --set train.elastic_nnodes=3:4

Exact resume: with ``train.deterministic`` on CPU, a run that crashes and resumes produces
bit-identical weights and per-step losses to an uninterrupted one of the same world size
(tested under torchrun with 2 and 3 ranks), because everything that decides the next step is
restored at the same step: weights, optimizer moments, scheduler, loader cursor, step/token
counters and every RNG, and DDP reduces every step in one gradient layout (``exact_ddp``).
``RUN_DIR/trace-rank{R}.jsonl`` records the loss and the sample ids of every step (every
attempt appends) so runs can be compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.ddp import exact_ddp
from steadytrain.errors import CheckpointError
from steadytrain.redact import redact
from steadytrain.run import Run
from steadytrain.run_inplace import decide, form_group
from steadytrain.storage.publish import publish_bytes
from steadytrain.train.config import Config
from steadytrain.train.evaluation import eval_batches, evaluate
from steadytrain.train.faults import FaultInjector, faults_from_env
from steadytrain.train.model import GPT, GPTConfig
from steadytrain.train.support import (
    StepTrace,
    check_world_sizes,
    goodput_so_far,
    preflight,
    say,
    say_fetched,
    start_prefetchers,
    weights_digest,
)
from steadytrain.train.torch_save import TorchSaveCheckpointer

__all__ = ["run_training", "TrainState", "lr_factor"]


class TrainState:
    """The loop's own counters, checkpointed with everything else (JSON)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` (nanoGPT)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step >= total:
        return min_ratio
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_ratio)


def run_training(
    cfg: Config, *, make_loader: Callable[..., TokenLoader] = TokenLoader
) -> dict[str, Any]:
    """Run (or resume) the job described by ``cfg``; returns a summary (rank 0's view).
    ``make_loader`` builds the loader (called like ``TokenLoader``): incident replays pass
    a deliberately naive one (``steadytrain.testing.naive_loader``)."""
    # -- 1. Processes: one per rank, started by torchrun (or alone: a world of one) -------
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # Before any heavy work: this world size must split the global batch (ConfigError, exit
    # 2), and every other one the elastic range allows is named now, not after a lost node.
    elastic = check_world_sizes(
        cfg.data.global_batch,
        cfg.data.micro_batch,
        world,
        int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        cfg.train.nnodes_range,
    )
    if elastic and rank == 0:
        say(elastic)
    use_cuda = cfg.train.device == "cuda" or (
        cfg.train.device == "auto" and torch.cuda.is_available()
    )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # train.backend_timeout_s: the collective timeout (0: torch's default, gloo 30 min).
    pg_timeout = (
        timedelta(seconds=cfg.train.backend_timeout_s) if cfg.train.backend_timeout_s else None
    )
    # In-place recovery ([recovery], steadytrain/run_inplace.py): under the keeper, Run forms
    # the group itself (on a prefix a regroup can renew) and rebuilds DDP after a regroup;
    # FSDP2 shards the model first, so the group is formed here (form_group), and every rank
    # restores its own shard from the memory tier after a regroup.
    recovery = cfg.recovery
    if recovery.inplace and use_cuda:
        if rank == 0:
            say("in-place recovery is off: it is proven on CPU (gloo) only; a fault restarts "
                "the job")  # fmt: skip
        recovery = dataclasses.replace(recovery, inplace=False)
    inplace, _ = decide(
        recovery,
        os.environ,
        world_size=world,
        group_exists=False,
        rebuildable_checkpoint=cfg.checkpoint.engine != "torch_save",
    )
    if inplace and cfg.train.parallel == "fsdp":
        form_group(recovery, timeout_s=cfg.train.backend_timeout_s or 600.0)  # Run takes it
    elif inplace:
        pass  # Run forms the group
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=pg_timeout)
    else:  # plain `steadytrain train`: a one-rank group, so every code path is the same
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # Everything opened from here on is closed on the way out, newest first, whether the run
    # finishes or fails: the checkpointer first waits for its save in flight (it may be the
    # newest recovery point), fetch threads and loader workers stop, the ledger gets its
    # job_end (with the error, if any), and the process group goes last.
    with contextlib.ExitStack() as closing:
        closing.callback(lambda: dist.is_initialized() and dist.destroy_process_group())
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic:
            # Bit-exact resume needs every kernel to be deterministic (CPU: all of ours are).
            torch.use_deterministic_algorithms(True)
        run_dir = cfg.run_dir
        os.makedirs(run_dir, exist_ok=True)
        faults = FaultInjector(faults_from_env(cfg.faults), run_dir, rank)

        # -- 2. Data: open the datasets (through the node-local cache when remote) -----------
        cache_dir = os.path.expandvars(cfg.data.cache_dir) or None  # e.g. $SLURM_TMPDIR/cache
        datasets = []
        for url in cfg.data.urls:  # one, or several blended by data.weights
            datasets.append(TokenDataset.open(url, cache_dir=cache_dir))
            closing.callback(datasets[-1].close)
        # The order is a pure function of (datasets, weights, seed, seq_len, position): rank r
        # of W takes its slice of each global batch, whatever W was when the checkpoint was
        # made. The loader checks that W divides the batch.
        loader = make_loader(datasets, rank=rank, world_size=world, seed=cfg.seed, config=cfg.data)
        closing.enter_context(loader)
        accum = loader.micro_per_step  # micro-batches per step on this rank
        shift_labels = cfg.data.labels == "same"  # the GPT does not shift (model.py)
        tokens_per_step = cfg.data.global_batch * cfg.data.seq_len

        # -- 3. Model: weights are a function of the seed; DDP or FSDP2 -----------------------
        torch.manual_seed(cfg.seed)  # dropout's RNG (checkpointed per rank)
        vocab = cfg.model.vocab_size or max(ds.vocab_size for ds in datasets)
        model = GPT(
            GPTConfig(
                vocab_size=vocab,
                seq_len=cfg.data.seq_len,
                n_layer=cfg.model.n_layer,
                n_head=cfg.model.n_head,
                n_embd=cfg.model.n_embd,
                dropout=cfg.model.dropout,
                bias=cfg.model.bias,
            ),
            seed=cfg.seed,
        ).to(device)

        def make_ddp() -> Any:
            # exact_ddp: every step reduces its gradients in the same bucket layout, in every
            # attempt, so a resumed run stays bit-exact on 3+ ranks too (steadytrain/ddp.py).
            return exact_ddp(DDP(model, device_ids=[local_rank] if use_cuda else None))

        if cfg.train.parallel == "fsdp":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            ddp_model = model
        elif not inplace:  # in place: after Run formed the group (run.wrap, below)
            ddp_model = make_ddp()

        def drop_ddp() -> None:
            # Before the group goes (callbacks run newest first): a DDP freed after it holds
            # the group's last reference and frees it with the GIL held, joining gloo's
            # threads while one may wait for the GIL to free the last collective's work.
            nonlocal ddp_model
            ddp_model = None
            gc.collect()

        closing.callback(drop_ddp)
        # bf16 autocast on GPU; fp32 on CPU (exact and, at this size, no slower).
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda else nullcontext()

        # -- 4. Optimizer: AdamW (decay on matrices only), warm-up then cosine decay ----------
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optim = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            foreach=False,  # the plain per-parameter kernel: same bits on every run
        )
        total = cfg.train.max_steps
        min_ratio = cfg.optim.min_lr / cfg.optim.lr
        sched = torch.optim.lr_scheduler.LambdaLR(
            optim, lambda s: lr_factor(s, cfg.optim.warmup_steps, total, min_ratio)
        )

        # -- 5. The public entry: ledger, checkpointer, watchdog; resume from the newest ------
        # committed checkpoint. `Run` is what a user's own loop holds too (steadytrain/run.py):
        # start-up and restart accounting, the hang watchdog, crash recording, the final save
        # and the closing order live there, not here.
        # MLflow is on by default; without its packages the run warns once and goes on.
        monitor = cfg.monitor.without_missing_extras(say if rank == 0 else None)
        if cfg.checkpoint.engine == "torch_save":  # the synchronous baseline (benchmarks)
            checkpoint: Any = TorchSaveCheckpointer(
                cfg.checkpoint_dir, cfg.checkpoint.every_steps, None
            )
        else:  # Run builds the Checkpointer (its own gloo group: async writes on DDP's deadlock)
            checkpoint = cfg.checkpoint
        state = TrainState()
        states = {"model": model, "optim": optim, "sched": sched, "loader": loader, "train": state}
        run = Run(
            run_dir,
            states,
            rank=rank,
            world_size=world,
            total_steps=total,
            checkpoint=checkpoint,
            checkpoint_dir=cfg.checkpoint_dir,
            monitor=monitor,
            config=redact(cfg.to_dict()),  # the ledger and MLflow params never hold secrets
            device=device.type,  # "auto" resolved: the alerts' advice fits the hardware
            backend_timeout_s=cfg.train.backend_timeout_s or None,
            recovery=recovery,
            say=say,
        )
        closing.enter_context(run)  # its exit: final save, in-flight save, watchdog, ledger
        if inplace and cfg.train.parallel == "ddp":  # built again after each regroup (hold
            ddp_model = run.wrap(make_ddp)  # no other reference); FSDP2 is rebound, not rebuilt
        step = run.start_step
        if step != state.step:
            raise CheckpointError(
                f"checkpoint step {step} disagrees with its saved train state step {state.step}"
            )
        node_ranks = list(range(rank, rank + int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        if local_rank == 0 and cfg.data.preflight:
            preflight(loader, step, total, node_ranks)  # after restore: the steps ahead of us
        # On the way out, after the prefetchers stop: what this process fetched that the
        # node's cache lacked (a staged spare says 0; a partly staged one, how much).
        closing.callback(say_fetched, loader, rank, local_rank == 0)
        if local_rank == 0 and cfg.data.prefetch_steps:
            # Remote data: the order is known, so one fetcher per node (and dataset) pulls the
            # shards of the node's ranks for the next N steps ahead of need (none when local).
            for prefetcher in start_prefetchers(loader, node_ranks, cfg.data, total):
                closing.enter_context(prefetcher)
        trace = StepTrace(run_dir, rank, world, attempt, run.attempt_id, enabled=cfg.train.trace)
        closing.enter_context(trace)
        if rank == 0:
            where = f"resumed from step {step}" if step else "starting from scratch"
            say(
                f"attempt {run.attempt}, {world} rank(s) on {device.type}, "
                f"{model.num_params() / 1e6:.2f}M parameters, {where}, {total} steps"
            )

        # Evaluation (train.eval_every): a fixed sample, read once (train/evaluation.py).
        eval_set = (
            eval_batches(datasets, rank=rank, world=world, seed=cfg.seed + 1, config=cfg.data,
                         count=cfg.train.eval_batches)
            if cfg.train.eval_every else []
        )  # fmt: skip

        # -- 6. The loop ----------------------------------------------------------------------
        model.train()
        batches = iter(loader)
        t_log, tokens_log, wait_log, block_log = time.perf_counter(), 0, 0.0, 0.0
        while step < total:
            # A peer lost inside the block, with in-place recovery on: the states roll back
            # and s.next is the step to redo from (Run.recoverable); otherwise step + 1.
            with run.recoverable(step) as s:
                trace.begin(run.attempt_id)  # a redone step is the new attempt's
                t0 = time.perf_counter()
                data_wait = faults.before_data(step + 1)  # an injected slow/stalled read
                forward_s = 0.0  # local compute before any collective (DDP syncs in backward)
                losses = []
                for micro in range(accum):
                    t_data = time.perf_counter()
                    batch = next(batches)
                    data_wait += time.perf_counter() - t_data
                    x = batch["input_ids"].to(device, non_blocking=True)
                    y = batch["labels"].to(device, non_blocking=True)
                    if shift_labels:  # data.labels = "same": next-token targets, last one ignored
                        y = F.pad(y[:, 1:], (0, 1), value=-100)  # cross_entropy's ignore_index
                    trace.add(batch)  # its sample ids, when tracing
                    # Gradients are all-reduced once per step, on the last micro-batch.
                    sync = micro == accum - 1 or cfg.train.parallel == "fsdp"
                    with nullcontext() if sync else ddp_model.no_sync(), autocast:
                        t_fwd = time.perf_counter()
                        _, loss = ddp_model(x, y)
                        forward_s += time.perf_counter() - t_fwd
                    (loss / accum).backward()
                    losses.append(loss.detach())
                faults.mid_step(step + 1)  # an injected crash between backward and update
                # The reported loss is the mean over all ranks (one small all-reduce). It runs
                # before the update on purpose: a peer lost in it (or anywhere before
                # optimizer.step) leaves every survivor's model and optimizer at the start of
                # this step, which in-place recovery resumes from without any copy
                # (inplace/live.py); after the update, only a snapshot could.
                local_loss = torch.stack(losses).mean().float().cpu()
                global_loss = local_loss.clone()
                dist.all_reduce(global_loss)
                global_loss = float(global_loss) / world
                if cfg.optim.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
                step += 1
                state.step, state.tokens = step, state.tokens + tokens_per_step

                # Checkpoint if due (every rank snapshots, the write continues in the background),
                # record the step, beat the hang watchdog: one call (steadytrain/run.py).
                block_s = run.step_done(
                    step,
                    tokens=tokens_per_step,
                    loss=global_loss,
                    data_wait_s=data_wait,
                    compute_s=max(0.0, time.perf_counter() - t0 - data_wait),
                    tokens_seen=state.tokens,
                    forward_s=forward_s,
                    loader=loader,
                )
                faults.after_save_started(step)  # an injected crash while that save is written
                trace.write(step, global_loss, float(local_loss), sched.get_last_lr()[0])
                if eval_set and step % cfg.train.eval_every == 0:
                    # A legitimately long part of the loop: the watchdog gives it the eval
                    # phase's deadline (phases.eval_s, default checkpoint_s), and the ledger
                    # books its seconds in the eval bucket (Run.phase).
                    with run.phase("eval"):
                        eval_loss = evaluate(model, eval_set, device, shift_labels=shift_labels,
                                             autocast=autocast)  # fmt: skip
                    if rank == 0:
                        say(f"eval at step {step}: loss {eval_loss:.4f}")
                tokens_log += tokens_per_step
                wait_log += data_wait
                block_log += block_s
                if rank == 0 and (step % cfg.train.log_every == 0 or step == total):
                    dt = time.perf_counter() - t_log
                    say(
                        f"step {step:>5}/{total} | loss {global_loss:.4f} | "
                        f"{tokens_log / dt / 1e3:7.1f}k tok/s | data wait {100 * wait_log / dt:4.1f}% "
                        f"| ckpt block {block_log * 1e3:5.1f} ms | goodput {goodput_so_far(run.meter)}"
                    )
                    t_log, tokens_log, wait_log, block_log = time.perf_counter(), 0, 0.0, 0.0
            step = s.next

        # -- 7. Finish: the final state is committed (`closing` closes the rest) -----------
        run.finish()  # the last step, even when it is not a multiple of every_steps
        weights = weights_digest(model)
        if rank == 0:  # atomic: a reader (the demo, a test) never parses half of it
            final = {"step": step, "tokens": state.tokens, "weights": weights}
            try:
                publish_bytes(os.path.join(run_dir, "final.json"), json.dumps(final))
            except OSError as e:  # the run directory's disk failed: the training did not
                say(f"warning: {run_dir}/final.json not written ({e}); trained to step {step}")
    return {"step": step, "tokens": state.tokens, "weights": weights, "run_dir": run_dir}
