"""What being ready for in-place recovery costs a steady step (issue 44 section 2: <= 1 %).

    python bench/inplace_step_cost.py [--every 1] [--rounds 60] [--block 1] [--width 1024]
        [--layers 12] [--batch 64] [--out bench/results/inplace_step_cost.json]

One job under the real torchrun and the keeper (2 gloo ranks, CPU, one thread each),
``bench/_inplace_step_worker.py``: the same DDP model and data, interleaved in blocks of
``--block`` steps (default 1: step by step, so that neighbours share the machine's load),
the order rotating every round: the plain step (``off``), the step inside
``with recovery.step(step)`` with the live recovery point alone (``live``: no snapshot,
``every_steps=0``, the default), the same with a snapshot **every** step copied beside it
(``background``), and with the whole copy blocking the step (``sync``). ``--every K``: a
snapshot every K of the steps taken with ``Recovery`` (``every_steps``; use a ``--block``
that is a multiple of K). Cost = a block's median step over the ``off`` block of the same
round, minus 1: the median of the rounds and their spread. A snapshot every step is the
worst case; with ``every_steps=K`` the copy happens every K-th step. Beside the wall-clock
ratio, the time each step spent inside ``Recovery._before`` (the work the live point adds
at the start of a step, measured inside the worker: wall clock and the thread's CPU time,
which the machine's other load does not inflate) as a share of the median ``off`` step, and the load average over the run. ``--steps-from DIR`` summarises the
``steps.jsonl`` of an earlier run instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_inplace_step_worker.py")


def read_steps(out: str) -> list[dict]:
    with open(os.path.join(out, "steps.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(args: argparse.Namespace) -> list[dict]:
    out = tempfile.mkdtemp(prefix="inplace-step-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the keeper needs the shared store
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=0"]
    cmd += ["-m", "steadytrain.inplace.keeper", WORKER, out]
    cmd += [str(v) for v in (args.rounds, args.block, args.width, args.layers, args.batch)]
    cmd += [str(args.every)]
    print(f"steps in {out}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    return read_steps(out)


def summarise(steps: list[dict], rounds: int) -> dict:
    def block(r: int, mode: str) -> float:
        return statistics.median(s["s"] for s in steps if s["round"] == r and s["mode"] == mode)

    modes = ("off", "live", "background", "sync")
    result: dict = {}
    for mode in modes:
        result[f"{mode}_step_s"] = round(
            statistics.median(block(r, mode) for r in range(rounds)), 4
        )
    for mode in modes[1:]:
        for key, name in (("before_s", "before_ms"), ("before_cpu_s", "before_cpu_ms")):
            inside = [s[key] for s in steps if s["mode"] == mode]
            result[f"{mode}_{name}"] = {
                "median": round(1e3 * statistics.median(inside), 3),
                "max": round(1e3 * max(inside), 3),
                "pct_of_off_step": round(100 * statistics.median(inside) / result["off_step_s"], 3),
            }
    loads = [s["load"] for s in steps]
    result["load_avg_1m_in_run"] = {
        "min": round(min(loads), 1),
        "median": round(statistics.median(loads), 1),
        "max": round(max(loads), 1),
    }
    for mode in modes[1:]:
        costs = [100 * (block(r, mode) / block(r, "off") - 1) for r in range(rounds)]
        result[f"{mode}_cost_pct"] = {
            "median": round(statistics.median(costs), 2),
            "q1_q3": [round(q, 2) for q in statistics.quantiles(costs, n=4)[::2]],
            "min": round(min(costs), 2),
            "max": round(max(costs), 2),
            "each": [round(c, 2) for c in costs],
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "inplace_step_cost.json"))
    ap.add_argument("--steps-from", default=None)
    args = ap.parse_args()
    t = time.time()
    steps = read_steps(args.steps_from) if args.steps_from else run(args)
    params = args.layers * (args.width * args.width + args.width)
    result = {
        "ranks": 2,
        "state_mb": round(params * 4 * 3 / 1e6),  # fp32 weights + AdamW's two moments
        "rounds": args.rounds,
        "block": args.block,
        "batch": args.batch,
        "every_steps": args.every,
        # of this run (None when summarising an earlier run's steps)
        "load_avg_1m": None if args.steps_from else round(os.getloadavg()[0], 1),
        "wall_s": None if args.steps_from else round(time.time() - t, 1),
        **summarise(steps, args.rounds),
    }
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
