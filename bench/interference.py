"""Interference: how much the loader's and the checkpoint writer's background work slows
the training step (issue 13 item 2, "Measure what a GPU job feels").

A GPU job feels background work where its Python thread does: the thread that launches
kernels and steps the optimizer holds the GIL most of the time, so a background thread that
wants the GIL, or a process that takes the core it runs on, stretches every step. Part A
measures that directly; part B shows it where a user sees it, in a short real training run.

**A. Step slowdown.** One process, ``torch.set_num_threads(1)``. The step is a tiny GPT
(6 layers, width 32, 2 micro-batches of 4 x 32 tokens) forward and backward plus
``clip_grad_norm_`` and a per-parameter ``AdamW`` (``foreach=False``): a few thousand small
torch ops a step, each mostly Python and dispatch, which is how a launch-bound GPU loop
holds the GIL (not a sleep). Contenders, each built once and kept warm:

- ``baseline``: no background work, batches from a list in memory;
- ``loader_thread``: ``TokenLoader`` with its defaults (``num_workers=0``: one background
  thread, ``prefetch=4``), ``loader_w1`` / ``loader_w2``: 1 or 2 worker processes;
- ``ckpt_thread`` / ``ckpt_process``: a ``Checkpointer`` (``async_mode`` thread or process)
  that starts a save every ``--save-every`` steps (0: a save ALWAYS in flight, the next one
  at the step after the previous one is durable); the state is the model, the optimizer and
  ``--ballast-mib`` of extra tensors so that one save spans many steps, as a real model's
  does; ``ckpt_floor``: the same bytes written with nothing else (``_floor_writer.py``);
- ``defaults``: loader thread and checkpoint thread together (the shipped defaults);
  ``w1_process``: 1 loader worker and process-mode checkpoints together.

A step's time is its compute only: ``next()`` waits and a save's blocking copy are left
out (the ledger books them as data wait and checkpoint block). Each round runs every
contender once, in an order that rotates by one place per round, ``--warmup`` steps then
``--steps`` timed ones, right after a baseline block of its own; a contender's slowdown in a
round is its median step time over that baseline block's median, minus 1, on wall time (the
headline: what the job feels, a core taken by the writer included) and, beside it, on wall
time minus the run-queue wait (``free_core``: the step as it would run with a core free for
the background work; it hides the writer's CPU where cores are scarce). Reported: min /
median / max over rounds with a 95 % interval for the median; the median step of the steps
that ran beside a save ("in flight"); and the throughput slowdown, every timed step's total
over the paired baselines' total (what a job's wall time feels at this save cadence) with a
bootstrap 95 % interval over rounds.

**B. A short real run.** ``steadytrain train demo`` (the real loop, one process) per mode,
in rotating order over ``--train-reps`` repetitions, checkpoints every ``--every`` steps:
kept steps per wall second (whole process, and the loop alone) next to the ledger's goodput
and its ``slowdown`` badput bucket, so the table shows both views.

    .venv/bin/python bench/interference.py [--rounds 7] [--steps 20] [--train-reps 2]

Writes bench/results/interference.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SEQ, MICRO, ACCUM = 32, 4, 2
GPT_SHAPE = {"n_layer": 6, "n_head": 4, "n_embd": 32}
# loader setting, checkpoint mode: None is "none of it" (batches from memory, no saves).
CONTENDERS: dict[str, tuple[str | None, str | None]] = {
    "baseline": (None, None),
    "loader_thread": ("thread", None),
    "loader_w1": ("w1", None),
    "loader_w2": ("w2", None),
    "ckpt_thread": (None, "thread"),
    "ckpt_process": (None, "process"),
    "ckpt_floor": (None, "floor"),  # the same bytes at the same pace, no Python per item
    "defaults": ("thread", "thread"),
    "w1_process": ("w1", "process"),
}
DEFAULTS = ("loader_thread", "ckpt_thread", "defaults")
# The headline is wall time, as is: on a machine whose cores are scarce, a writer's CPU
# takes the training thread's core, and a job feels that. Beside it, "free_core" leaves
# the run-queue waits out (the step as it would run with a core free for the background
# work), which hides exactly that cost, so it is never the headline.
VIEWS = ("wall", "free_core")
# Part B: one rank, ~0.8M parameters (~10 MB with AdamW's moments: a save spans steps).
TRAIN_MODEL = (
    "model.n_layer=4 model.n_head=4 model.n_embd=128 data.seq_len=32 data.global_batch=8 "
    "data.micro_batch=4 train.threads=1 train.log_every=1000 train.trace=false "
    'optim.warmup_steps=5 monitor.sinks=["jsonl"]'
).split()
TRAIN_MODES = {
    "no_checkpoints": ["checkpoint.every_steps=0"],  # the loop still saves the last step
    "defaults": [],  # loader thread, checkpoint thread
    "ckpt_process": ["checkpoint.async_mode=process"],
    "ckpt_sync": ["checkpoint.async_mode=sync"],
    "loader_w1": ["data.num_workers=1"],
}


def warm_memory(dest: str, gib: float) -> dict[str, float]:
    """Write ``gib`` GiB through the page cache and delete it, before anything is timed.

    Guest memory that a virtual machine has not touched (since boot, or since it reported
    the pages free to its host) is not backed by the host: the first write to each page
    faults to the host. On the 2026-12-01 VM a 70 MB checkpoint ``writev`` into such pages
    took ~200 ms, against ~17 ms into pages just freed (a one-off check). Every contender,
    the baseline included, starts after this warm-up; its rate goes into the JSON as a
    reading of the machine's state (285-360 MB/s on untouched memory there, 1160 MB/s once
    the whole memory had been written). A VM that hands free pages back to its host may
    make them cold again, so this evens out the start, and no more."""
    path, chunk = os.path.join(dest, "warm-memory"), np.zeros(16 << 20, dtype=np.uint8)
    n = int(gib * (1 << 30)) // chunk.nbytes
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(chunk)
    except OSError as e:
        raise SystemExit(
            f"memory warm-up: writing {gib:g} GiB to {path} failed ({e.strerror}); "
            "free space there (TMPDIR), or pass a smaller --warm-gib (0: no warm-up)"
        ) from e
    finally:
        if os.path.lexists(path):
            os.unlink(path)
    took = time.perf_counter() - t0
    written = n * chunk.nbytes
    return {"gib": written / (1 << 30), "s": took, "mb_per_s": written / 1e6 / took}


def make_dataset(dest: str) -> str:
    """The stdlib's email package as bytes tokens, in ~50k-token shards."""
    from steadytrain.data.ingest.writer import DatasetWriter

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "email", "*.py")))
    tok = {"type": "bytes", "vocab_size": 257, "eos_id": 256}
    with DatasetWriter(dest, vocab_size=257, eos_id=256, tokenizer=tok, shard_tokens=50_000) as w:
        for path in files:
            with open(path, "rb") as f:
                doc = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
            w.add_document(np.append(doc, 256))
    return dest


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``xs``: the order
    statistics x_(k), x_(n+1-k) with the largest k whose binomial(n, 1/2) coverage is still
    at least ``level``. None when n is too small for any (n < 6 at 95 %)."""
    n, xs = len(xs), sorted(xs)
    below = 0.0  # P(Binomial(n, 1/2) < k): the chance the median lies below x_(k)
    k = 0
    while k < n // 2 and 1.0 - 2.0 * (below + math.comb(n, k) / 2.0**n) >= level:
        below += math.comb(n, k) / 2.0**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def spread(xs: list[float]) -> dict[str, Any]:
    ci = median_ci(xs)
    return {
        "min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs),
        "median_ci95": list(ci) if ci else None,
    }  # fmt: skip


def pooled_slowdown(pairs: list[tuple[float, float]], resamples: int = 2000) -> dict:
    """Throughput slowdown over all rounds: total compute time over the paired baselines'
    total, minus 1, in %; its 95 % interval resamples whole rounds (percentile bootstrap,
    fixed seed). What a job's wall time feels at the benchmark's save cadence."""
    import random

    def pct(ps: list[tuple[float, float]]) -> float:
        return 100.0 * (sum(c for c, _ in ps) / sum(b for _, b in ps) - 1.0)

    rng = random.Random(0)
    boot = sorted(pct(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
    lo, hi = boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
    return {"estimate": pct(pairs), "ci95": [lo, hi], "rounds": len(pairs)}


class Trainer:
    """The GIL-holding step: tiny GPT forward/backward, clipping, per-parameter AdamW."""

    def __init__(self) -> None:
        import torch

        from steadytrain.train.model import GPT, GPTConfig

        self.model = GPT(GPTConfig(vocab_size=257, seq_len=SEQ, **GPT_SHAPE), seed=0)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=False)

    def step(self, batches: Iterator[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step: its compute time (``next()`` waits left out) split into
        on-CPU, run-queue (ready, no core free) and blocked (off-CPU not ready: the GIL)."""
        import torch

        t0, s0, wait, wait_s = time.perf_counter(), _sched(), 0.0, (0.0, 0.0)
        for _ in range(ACCUM):
            tw, sw = time.perf_counter(), _sched()
            batch = next(batches)
            wait += time.perf_counter() - tw
            wait_s = tuple(a + b - c for a, b, c in zip(wait_s, _sched(), sw, strict=True))
            _, loss = self.model(batch["input_ids"], batch["labels"])
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        wall = time.perf_counter() - t0 - wait
        cpu, runq = (b - a - w for a, b, w in zip(s0, _sched(), wait_s, strict=True))
        blocked = max(0.0, wall - cpu - runq)
        return {"wall": wall, "cpu": cpu, "runq": runq, "blocked": blocked, "wait": wait}


_SCHEDSTAT = f"/proc/self/task/{threading.get_native_id()}/schedstat"


def _sched() -> tuple[float, float]:
    """This (main) thread's (on-CPU s, run-queue s): wall time minus both is time blocked
    (waiting for the GIL here), which other machines' load does not inflate the way it
    inflates wall time. The run-queue time is the kernel's schedstat ``run_delay``, exact
    while the thread runs (it grows only while the thread waits for a core). The CPU time is
    ``time.thread_time()``: schedstat's own ``sum_exec_runtime`` of a running thread is only
    brought up to date at a scheduler tick, so over a 15 ms step it is off by up to a tick
    (it read ~1 ms more CPU than wall time per step on the 2026-12-01 VM)."""
    with open(_SCHEDSTAT) as f:
        _, runq_ns, _ = f.read().split()
    return time.thread_time(), int(runq_ns) / 1e9


class Contender:
    """One way of running the step: where batches come from, and whether a save is in
    flight. Built once; its loader and checkpointer stay alive (idle) between its turns."""

    def __init__(
        self,
        name: str,
        trainer: Trainer,
        ds: Any,
        ckpt_dir: str,
        ballast: Any,
        period_s: float = 0.0,
        save_every: int = 0,
    ):
        from _floor_writer import FloorWriter
        from steadytrain.checkpoint import Checkpointer
        from steadytrain.data.read.loader import TokenLoader

        self.name, self.trainer = name, trainer
        loader_mode, ckpt_mode = CONTENDERS[name]
        self.loader = self.ckpt = None
        if loader_mode is not None:
            workers = {"thread": 0, "w1": 1, "w2": 2}[loader_mode]
            self.loader = TokenLoader(
                ds, seq_len=SEQ, global_batch=MICRO * ACCUM, micro_batch=MICRO,
                labels="next", num_workers=workers, seed=len(name),
            )  # fmt: skip
            self.batches: Iterator[dict[str, Any]] = iter(self.loader)
            next(self.batches)  # workers started and warm before any timing
        else:
            fixed = [
                {"input_ids": x, "labels": x}
                for x in np.random.default_rng(0).integers(0, 257, (16, MICRO, SEQ))
            ]
            import torch

            fixed = [{k: torch.from_numpy(v) for k, v in b.items()} for b in fixed]
            self.batches = (fixed[i % len(fixed)] for i in range(1 << 62))
        self.events: list[dict[str, Any]] = []
        self.saves = 0
        # 0: a save always in flight; N: a save starts every N steps (or, when the last one
        # is not durable yet, at the first step after it is)
        self.save_every, self.since_save = save_every, save_every
        self.save_s = 0.0  # median background time of a save (from save() to durable)
        if ckpt_mode == "floor":
            self.ckpt = FloorWriter(os.path.join(ckpt_dir, name), period_s, self.events.append)
        elif ckpt_mode is not None:
            self.ckpt = Checkpointer(
                os.path.join(ckpt_dir, name), every_steps=0, keep_last=2,
                async_mode=ckpt_mode, on_event=self.events.append,
            )  # fmt: skip
        if self.ckpt is not None:
            self.states = {"model": trainer.model, "optim": trainer.optim, "ballast": ballast}
            took = []
            for _ in range(3):  # buffers allocated, daemon started: not part of any round
                self._save()
                t0 = time.perf_counter()
                self.ckpt.wait()
                took.append(time.perf_counter() - t0)
            self.save_s = statistics.median(took)

    def durable_s(self) -> float | None:
        """Median background time of this contender's saves so far (save() to durable)."""
        took = [e["durable_s"] for e in self.events if e["type"] == "checkpoint"]
        return statistics.median(took[-8:]) if took else None

    def _save(self) -> None:
        assert self.ckpt is not None
        self.saves += 1
        self.ckpt.save(self.saves, self.states)

    def _in_flight(self) -> bool:
        assert self.ckpt is not None
        self.ckpt.maybe_save(0, self.states)  # never due (every_steps=0): delivers events
        done = [e for e in self.events if e["type"] == "checkpoint"]
        bad = [e for e in done if not e["ok"]]
        if bad:
            raise SystemExit(f"{self.name}: a checkpoint failed: {bad[-1]['error']}")
        return len(done) < self.saves  # each save, ok or not, ends with one event

    def run(self, warmup: int, steps: int) -> dict[str, Any]:
        got: list[dict[str, float]] = []
        saves0 = self.saves
        for i in range(warmup + steps):
            self.since_save += 1
            flying = self.ckpt is not None and self._in_flight()  # as a loop's maybe_save()
            if self.ckpt is not None and self.since_save >= self.save_every and not flying:
                self._save()  # its blocking copy is not timed
                self.since_save, flying = 0, True
            step = self.trainer.step(self.batches)
            if i >= warmup:
                got.append(step | {"in_flight": flying})
        if self.ckpt is not None:
            self.ckpt.wait()
            self._in_flight()  # delivers (and checks) the last event
        out: dict[str, Any] = {
            f"{k}_s": statistics.median(g[k] for g in got) for k in ("wall", "cpu", "blocked")
        }
        # wall - run-queue: the step on a machine with a free core for everything else
        out["free_core_s"] = statistics.median(g["wall"] - g["runq"] for g in got)
        out["runq_s"] = statistics.median(g["runq"] for g in got)
        # the block's whole compute time, for throughput: a median ignores the steps a
        # sparse save slows, a job's wall time does not
        out["total_free_core_s"] = sum(g["wall"] - g["runq"] for g in got)
        out["total_wall_s"] = sum(g["wall"] for g in got)
        flying = [g["wall"] - g["runq"] for g in got if g["in_flight"]]
        out["in_flight_steps"], out["steps"] = len(flying), len(got)
        out["in_flight_free_core_s"] = statistics.median(flying) if flying else None
        flying_wall = [g["wall"] for g in got if g["in_flight"]]
        out["in_flight_wall_s"] = statistics.median(flying_wall) if flying_wall else None
        out["data_wait_s"] = statistics.mean(g["wait"] for g in got)
        return out | {"saves": self.saves - saves0}

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.loader is not None:
            self.loader.close()


def _paired_round(
    contenders: dict[str, Contender], order: list[str], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """One round: every contender right after a baseline block of its own, and its slowdown
    against that block. This VM's speed drifts by tens of percent over seconds; a baseline
    a few hundred milliseconds away tracks it far better than one per round did. The
    baseline's row is the A/A test: each of its blocks against the one before (the noise
    any other row's figure carries), the median over the round."""
    got: dict[str, dict[str, Any]] = {}
    bases: list[dict[str, Any]] = []
    for n in order:
        base = contenders["baseline"].run(args.warmup, args.steps)
        got[n] = contenders[n].run(args.warmup, args.steps)
        for view in VIEWS:
            got[n][f"baseline_{view}_s"] = base[f"{view}_s"]
            got[n][f"baseline_total_{view}_s"] = base[f"total_{view}_s"]
        for view in VIEWS:
            ratio = got[n][f"{view}_s"] / base[f"{view}_s"]
            got[n][f"slowdown_{view}_pct"] = 100.0 * (ratio - 1.0)
        bases.append(base)
    got["baseline"] = dict(bases[0])
    # A/A for throughput too: each baseline block's total against the one before it
    for view in VIEWS:
        key = f"total_{view}_s"
        got["baseline"][key] = sum(b[key] for b in bases[1:])
        got["baseline"][f"baseline_{key}"] = sum(b[key] for b in bases[:-1])
        pairs = zip(bases, bases[1:], strict=False)
        aa = [100.0 * (b[f"{view}_s"] / a[f"{view}_s"] - 1.0) for a, b in pairs]
        got["baseline"][f"slowdown_{view}_pct"] = statistics.median(aa) if aa else 0.0
    return got, bases


def part_a(args: argparse.Namespace, tmp: str, dataset: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from steadytrain.data.read.dataset import TokenDataset

    if not os.path.exists(_SCHEDSTAT):
        raise SystemExit(
            f"{_SCHEDSTAT} is missing: part A needs Linux's per-thread schedstat (a kernel "
            "with CONFIG_SCHED_INFO); run part B alone with --rounds 0"
        )
    torch.set_num_threads(1)
    # process-mode checkpoints need a process group: one rank is enough
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    trainer = Trainer()
    ballast = torch.nn.Module()
    for i in range(8):  # eight tensors of --ballast-mib / 8 each
        ballast.register_buffer(f"t{i}", torch.randn(args.ballast_mib * (1 << 18) // 8))
    ds = TokenDataset.open(dataset)
    names = [n for n in CONTENDERS if n in args.contenders]
    contenders: dict[str, Contender] = {}
    for n in names:  # ckpt_floor comes after ckpt_thread, whose pace it keeps
        pace = contenders["ckpt_thread"].save_s if "ckpt_thread" in contenders else 0.0
        pace = 0.0 if args.save_every else pace  # a fixed cadence paces every writer alike
        contenders[n] = Contender(
            n, trainer, ds, os.path.join(tmp, "ckpt"), ballast, pace, args.save_every
        )
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            thread, floor = contenders.get("ckpt_thread"), contenders.get("ckpt_floor")
            if not args.save_every and thread and floor and thread.durable_s() is not None:
                # the floor keeps the thread writer's pace as it is now, not at warm-up
                floor.ckpt.period_s = thread.durable_s()
            got, bases = _paired_round(contenders, [n for n in order if n != "baseline"], args)
            rounds.append(
                {"order": order, "load1": os.getloadavg()[0], "results": got, "baselines": bases}
            )
            print(
                f"[bench] round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f}): "
                + ", ".join(
                    f"{n} {got[n]['slowdown_wall_pct']:+.1f}% "
                    f"({got[n]['slowdown_free_core_pct']:+.1f}% free core)"
                    for n in names[1:]
                ),
                flush=True,
            )
    finally:
        for c in contenders.values():
            c.close()
        ds.close()
        dist.destroy_process_group()
    summary = {}
    for n in names:
        per = [rd["results"][n] for rd in rounds]
        summary[n] = {k: spread([p[k] for p in per]) for k in per[0] if k.startswith("slow")}
        for k in ("wall", "free_core", "cpu", "blocked", "runq", "data_wait"):
            summary[n][f"{k}_ms"] = spread([1e3 * p[f"{k}_s"] for p in per])
        summary[n]["saves_per_round"] = spread([float(p["saves"]) for p in per])
        # headline: wall time; "_free_core" beside it (run-queue waits left out)
        summary[n]["throughput_slowdown_pct"] = pooled_slowdown(
            [(p["total_wall_s"], p["baseline_total_wall_s"]) for p in per]
        )
        summary[n]["throughput_slowdown_free_core_pct"] = pooled_slowdown(
            [(p["total_free_core_s"], p["baseline_total_free_core_s"]) for p in per]
        )
        summary[n]["in_flight_share"] = sum(p["in_flight_steps"] for p in per) / sum(
            p["steps"] for p in per
        )
        for view, suffix in (("wall", ""), ("free_core", "_free_core")):
            flying = [
                100.0 * (p[f"in_flight_{view}_s"] / p[f"baseline_{view}_s"] - 1.0)
                for p in per
                if p[f"in_flight_{view}_s"] is not None
            ]
            summary[n][f"slowdown_in_flight{suffix}_pct"] = spread(flying) if flying else None
        summary[n]["save_background_s"] = contenders[n].save_s
        summary[n]["durable_s_median"] = contenders[n].durable_s()
    return {"summary": summary, "rounds": rounds}


def train_run(mode: str, run_dir: str, dataset: str, args: argparse.Namespace) -> dict:
    from steadytrain.monitor.goodput import compute_goodput
    from steadytrain.monitor.ledger import read_ledger

    cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
    settings = TRAIN_MODEL + TRAIN_MODES[mode]
    settings += [f"run_dir={run_dir}", f"data.dataset={dataset}"]
    settings += [f"train.max_steps={args.train_steps}", f"checkpoint.every_steps={args.every}"]
    if mode == "no_checkpoints":
        settings.remove(f"checkpoint.every_steps={args.every}")
    for s in settings:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"train {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    b = compute_goodput(records)
    steps = [r for r in records if r["type"] == "step"]
    loop_s = steps[-1]["t"] - (steps[0]["t"] - steps[0]["step_s"])
    return {
        "mode": mode,
        "wall_s": wall,
        "kept_steps_per_wall_s": b.steps_kept / wall,
        "loop_steps_per_s": len(steps) / loop_s,
        "goodput": b.goodput,
        "total_s": b.total_s,
        "steps_kept": b.steps_kept,
        "badput_s": b.badput_s,
        "slowdown_share": b.badput_s["slowdown"] / b.total_s,
        "median_step_s": statistics.median(r["step_s"] for r in steps),
        "saves": sum(1 for r in records if r["type"] == "checkpoint" and r.get("ok")),
    }


def part_b(args: argparse.Namespace, tmp: str, dataset: str) -> dict[str, Any]:
    modes, runs = [m for m in TRAIN_MODES if m in args.train_modes], []
    for rep in range(args.train_reps):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            out = train_run(mode, os.path.join(tmp, f"train-{mode}-{rep}"), dataset, args)
            print(
                f"[bench] train {mode} rep {rep}: {out['kept_steps_per_wall_s']:.2f} kept "
                f"steps/wall s, loop {out['loop_steps_per_s']:.2f} steps/s, goodput "
                f"{out['goodput']:.3f}, slowdown {out['slowdown_share']:.3%}",
                flush=True,
            )
            runs.append(out | {"rep": rep, "load1": os.getloadavg()[0]})
    keys = ("kept_steps_per_wall_s", "loop_steps_per_s", "goodput", "slowdown_share")
    summary = {m: {k: spread([r[k] for r in runs if r["mode"] == m]) for k in keys} for m in modes}
    return {"summary": summary, "runs": runs}


def run_info() -> dict[str, Any]:
    """The command, when, the load it started under and the code it measured (the writer
    and the loader change under a benchmark on a shared branch)."""
    git = ["git", "status", "--porcelain", "src/steadytrain/checkpoint", "src/steadytrain/data"]
    dirty = subprocess.run(git, cwd=REPO, capture_output=True, text=True).stdout.split("\n")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return {
        "command": "python bench/interference.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_start": os.getloadavg(),
        "code": {"head": head.stdout.decode().strip(), "uncommitted": [d for d in dirty if d]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="0: skip part A")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--ballast-mib", type=int, default=64, help="extra checkpointed state")
    p.add_argument(
        "--save-every", type=int, default=0,
        help="part A: start a save every N steps (0: a save always in flight, the worst case)",
    )  # fmt: skip
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument(
        "--warm-gib", type=float, default=4.0,
        help="write and delete this much first, so no contender pays a fresh VM's first "
        "touches of its memory (0: off)",
    )  # fmt: skip
    p.add_argument("--train-reps", type=int, default=2, help="0: skip part B")
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="part B: checkpoint every N steps")
    p.add_argument("--train-modes", default=",".join(TRAIN_MODES))
    p.add_argument("--out", default=os.path.join(HERE, "results", "interference.json"))
    p.add_argument("--update", action="store_true", help="keep the part not run from --out")
    args = p.parse_args()
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.train_modes = [m for m in args.train_modes.split(",") if m]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    unknown += sorted(set(args.train_modes) - set(TRAIN_MODES))
    if unknown or "baseline" not in args.contenders:
        raise SystemExit(
            f"unknown contenders/modes {unknown} (use {sorted(CONTENDERS)} and "
            f"{sorted(TRAIN_MODES)}); --contenders must include baseline"
        )
    if not args.rounds and not args.train_reps:
        p.error(f"--rounds 0 and --train-reps 0: nothing to run (and {args.out} is kept)")
    if args.warm_gib < 0:
        p.error(f"--warm-gib {args.warm_gib:g}: use 0 (no warm-up) or more")
    run = run_info()
    with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
        if args.warm_gib:
            run["warm_memory"] = warm_memory(tmp, args.warm_gib)
            print(f"[bench] memory warmed: {run['warm_memory']}", flush=True)
        dataset = make_dataset(os.path.join(tmp, "ds"))
        a = part_a(args, tmp, dataset) if args.rounds else None
        b = part_b(args, tmp, dataset) if args.train_reps else None
    run["load_average_end"] = os.getloadavg()
    doc: dict[str, Any] = {"step_slowdown": None, "training": None}
    if args.update and os.path.exists(args.out):  # rerun one part, keep the other
        with open(args.out) as f:
            doc = json.load(f)
    settings_a = {
        "step": {"gpt": GPT_SHAPE, "seq_len": SEQ, "micro_batch": MICRO, "accum": ACCUM,
                 "threads": 1, "optimizer": "AdamW foreach=False, clip_grad_norm_"},
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "ballast_mib": args.ballast_mib, "save_every": args.save_every,
        "warm_gib": args.warm_gib,
    }  # fmt: skip
    settings_b = {"model": TRAIN_MODEL, "steps": args.train_steps, "every_steps": args.every}
    if a is not None:
        doc["step_slowdown"] = a | {"run": run, "settings": settings_a}
    if b is not None:
        doc["training"] = b | {"run": run, "settings": settings_b}
    a = doc["step_slowdown"]
    doc |= {
        "benchmark": "interference",
        "machine": f"{os.cpu_count()} CPU cores, shared with other work",
        "goal": "slowdown <= 2 % (median over rounds, wall time) with the default modes",
        "headline_view": "wall (free_core beside it: run-queue waits left out)",
        # where the 95 % interval for that median reaches above 2 %, the rounds cannot tell
        "defaults_median_ci95_pct": {
            n: {v: a["summary"][n][f"slowdown_{v}_pct"]["median_ci95"] for v in VIEWS}
            for n in DEFAULTS
            if a is not None and n in a["summary"]
        },
        "defaults_throughput_pct": {
            n: {
                "wall": a["summary"][n]["throughput_slowdown_pct"],
                "free_core": a["summary"][n].get("throughput_slowdown_free_core_pct"),
            }
            for n in DEFAULTS
            if a is not None and n in a["summary"] and "throughput_slowdown_pct" in a["summary"][n]
        },
        "defaults_met": {
            n: {v: a["summary"][n][f"slowdown_{v}_pct"]["median"] <= 2.0 for v in VIEWS}
            for n in DEFAULTS
            if a is not None and n in a["summary"]
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[bench] wrote {args.out}")
    for n, s in (a or {"summary": {}})["summary"].items():
        line = f"  {n:14s} step {s['wall_ms']['median']:7.2f} ms"
        for v in VIEWS:
            sd = s[f"slowdown_{v}_pct"]
            line += f" | {v} {sd['min']:+6.1f} / {sd['median']:+6.1f} / {sd['max']:+6.1f} %"
            if sd.get("median_ci95"):
                line += " (median {:+.1f} to {:+.1f})".format(*sd["median_ci95"])
        saves = s["saves_per_round"]["median"]
        line += f" | blocked {s['blocked_ms']['median']:.2f} ms | saves/round {saves:g}"
        if "throughput_slowdown_pct" in s:
            tp, fly = s["throughput_slowdown_pct"], s["slowdown_in_flight_pct"]
            line += " | throughput wall {:+.1f} % ({:+.1f} to {:+.1f})".format(
                tp["estimate"], *tp["ci95"]
            )
            tf = s.get("throughput_slowdown_free_core_pct")
            line += f", free core {tf['estimate']:+.1f} %" if tf else ""
            line += f" | in flight {100 * s['in_flight_share']:.0f} % of steps"
            line += f", those {fly['median']:+.1f} %" if fly else ""
        print(line)


if __name__ == "__main__":
    main()
