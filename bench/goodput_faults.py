"""Goodput under injected failures: async sharded checkpoints vs synchronous torch.save.

Two runs of the reference loop under ``torchrun --nproc-per-node 2 --max-restarts 50`` on
CPU, identical except for the checkpoint engine:

- ``steadytrain``: the Checkpointer (DCP shards, thread-async, COMMIT last), every N steps;
- ``torch.save``: rank 0 writes one file synchronously every N steps, everyone waits.

Both see the same failures: rank 0 is SIGKILLed at wall-clock times drawn from an
exponential distribution (mean ``--mtbf`` seconds, fixed seed), counted from each run's
first start (``faults.mtbf_s``). Goodput is measured from each run's ledger
(``steadytrain.monitor.goodput``); next to it, the planner's prediction for the same
settings (``steadytrain.planning.goodput_exact``) from the costs measured in that ledger
(C = blocking part of a save, L = time until durable, R = restart cost, data stall share)
and the real interval (N x mean compute seconds per step).

    .venv/bin/python bench/goodput_faults.py [--steps 200] [--every 2] [--mtbf 30]

Writes bench/results/goodput_faults.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

MODEL = [  # ~3.7M parameters: ~44 MB of weights + Adam state, ~0.2 s a step per rank
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=384",
    "data.seq_len=32",
    "data.global_batch=16",
    "data.micro_batch=8",
    "train.threads=1",
    "train.log_every=20",
    "train.trace=false",
    "optim.warmup_steps=10",
]


def make_dataset(dest: str) -> str:
    from steadytrain.data.ingest.writer import DatasetWriter

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "email", "*.py")))
    with DatasetWriter(
        dest,
        vocab_size=257,
        eos_id=256,
        tokenizer={"type": "bytes", "vocab_size": 257, "eos_id": 256},
        shard_tokens=200_000,
    ) as w:
        for path in files:
            with open(path, "rb") as f:
                doc = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
            w.add_document(np.append(doc, 256))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, run_dir: str, dataset: str, args: argparse.Namespace, engine: list[str]):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=50",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.2",
        "-m",
        "steadytrain.cli",
        "train",
        "demo",
    ]
    for s in (
        MODEL
        + engine
        + [
            f"run_dir={run_dir}",
            f"data.dataset={dataset}",
            f"train.max_steps={args.steps}",
            f"checkpoint.every_steps={args.every}",
        ]
    ):
        cmd += ["--set", s]
    env = dict(
        os.environ,
        STEADYTRAIN_FAULTS=f"mtbf_s={args.mtbf};seed={args.seed}",
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    print(f"[bench] {name}: {' '.join(engine)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return measure(name, run_dir, args, wall)


def measure(name: str, run_dir: str, args: argparse.Namespace, wall: float) -> dict:
    from steadytrain.monitor.goodput import compute_goodput
    from steadytrain.monitor.ledger import read_ledger
    from steadytrain.planning import goodput_exact, goodput_first_order, measure_run

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    b = compute_goodput(records)
    costs = measure_run(run_dir)
    steps = [r for r in records if r["type"] == "step"]
    compute = float(np.mean([r["step_s"] - r["checkpoint_block_s"] for r in steps]))
    tau = args.every * compute  # wall seconds of training between two saves
    c = costs.ckpt_cost_s or 0.0
    l_s = costs.durable_s or c
    r = costs.restart_cost_s or 0.0
    s = costs.data_stall_frac
    pred = goodput_exact(tau, c, args.mtbf, restart_s=r, durable_s=l_s, stall_frac=s)
    pred1 = goodput_first_order(tau, c, args.mtbf, restart_s=r, durable_s=l_s, stall_frac=s)
    # The model describes the steady state; a short run also pays its first start-up once.
    first_startup = b.badput_s.get("startup", 0.0) / max(1, b.attempts)
    steady = b.goodput_s / max(1e-9, b.total_s - first_startup)
    out = {
        "name": name,
        "wall_s": wall,
        "goodput_measured": b.goodput,
        "goodput_measured_without_first_startup": steady,
        "goodput_predicted_exact": pred,
        "goodput_predicted_first_order": pred1,
        "restarts": b.attempts - 1,
        "steps_lost": b.steps_lost,
        "badput": b.badput_fraction(),
        "interval_s": tau,
        "ckpt_block_s": c,
        "ckpt_durable_s": l_s,
        "restart_s": r,
        "data_stall_frac": s,
        "compute_s_per_step": compute,
        "checkpoints": costs.checkpoints,
    }
    print(
        f"[bench] {name}: goodput {b.goodput:.3f} measured ({steady:.3f} without the first "
        f"start-up), {pred:.3f} predicted; {b.attempts - 1} restarts, C={c * 1e3:.0f} ms, "
        f"L={l_s * 1e3:.0f} ms, R={r:.1f} s, tau={tau:.2f} s",
        flush=True,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    p.add_argument("--mtbf", type=float, default=30.0, help="mean time between failures (s)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "goodput_faults.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="goodput-faults-") as tmp:
        dataset = make_dataset(os.path.join(tmp, "ds"))
        results = [
            run(
                "steadytrain async (DCP, thread)",
                os.path.join(tmp, "async"),
                dataset,
                args,
                ["checkpoint.engine=dcp", "checkpoint.async_mode=thread"],
            ),
            run(
                "torch.save sync (rank 0, one file)",
                os.path.join(tmp, "torch_save"),
                dataset,
                args,
                ["checkpoint.engine=torch_save"],
            ),
        ]
    doc = {
        "benchmark": "goodput_faults",
        "settings": {
            "steps": args.steps,
            "every_steps": args.every,
            "mtbf_s": args.mtbf,
            "seed": args.seed,
            "ranks": 2,
            "model": MODEL,
            "machine": f"{os.cpu_count()} CPU cores, gloo",
        },
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
