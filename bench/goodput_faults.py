"""Goodput under injected failures: async sharded checkpoints vs synchronous torch.save.

Two runs of the reference loop under ``torchrun --nproc-per-node 2 --max-restarts 50`` on
CPU, identical except for the checkpoint engine:

- ``steadytrain``: the Checkpointer (DCP shards, thread-async, COMMIT last), every N steps;
- ``torch.save``: rank 0 writes one file synchronously every N steps, everyone waits.

Both see the same failures: rank 0 is SIGKILLed at wall-clock times drawn from an
exponential distribution (mean ``--mtbf`` seconds), counted from each run's first start
(``faults.mtbf_s``), at the first step mid-point after that time, and only while an attempt
is up (a time that falls while the job is down is dropped); every seed of ``--seeds`` (default 10) is one pair of runs with its own
failure times. Goodput is measured from each run's ledger (``steadytrain.monitor.goodput``),
and beside it kept steps per wall second (a slowed step shows there whatever the ledger
says). Next to it, the planner's prediction: ``plan --from-run`` on that run's ledger
(``planning.plan_from_run``) with the run's measured costs (C = blocking part of a save,
L = time until durable as the injector sees it (``landed_s``), R = restart cost and the part
U of it failures can hit, stall share s = data wait + slowdown), the real interval (N x
mean wall seconds per step, the first step of each attempt left out: its warm-up is part
of R), the failure rate that run actually saw over the time its attempts were up (a seed
does not deliver the nominal ``--mtbf``) and its first start-up, over the run's own length
(docs/planning.md, "Against measurement"). Runs of a few failures overestimate a little
(about 4 points at 30 steps in simulation, within 1 at 200). Per engine the summary gives the mean
measured and predicted goodput over the seeds and their mean paired difference, each with
a 95 % t interval; the goal is agreement within 2 points.

That fit is in-sample: it is given what the run measured. Beside it, each labelled, the
**a-priori** prediction: before the seeds, one calibration run per engine
(``--calibration-steps``, killed at the fixed steps ``--calibration-kills`` so its restarts
give R) measures the costs and the first start-up, and the plan takes those with the
nominal failure rate ``--mtbf`` over the benchmark run's length (``a_priori``): what the
planner says before the run, set against every seed's measurement.

    .venv/bin/python bench/goodput_faults.py [--seeds 10] [--steps 200] [--every 2] [--mtbf 30]
        [--engines async,torch_save] [--calibration-steps 40] [--calibration-kills 10,25]
        [--keep DIR]   # --keep: keep the run directories

Writes bench/results/goodput_faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
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


def run(
    name: str,
    run_dir: str,
    dataset: str,
    args: argparse.Namespace,
    engine: list[str],
    faults: str | None = None,
    steps: int | None = None,
):
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
            f"train.max_steps={steps or args.steps}",
            f"checkpoint.every_steps={args.every}",
        ]
    ):
        cmd += ["--set", s]
    env = dict(
        os.environ,
        STEADYTRAIN_FAULTS=faults or f"mtbf_s={args.mtbf};seed={args.seed}",
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    print(f"[bench] {name}: {' '.join(engine)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    if faults is not None:
        return wall
    return measure(name, run_dir, args, wall)


def landed_s(costs, step_s: float) -> float | None:
    """The durable time ``L`` as this bench's failures see it.

    The injector (train/faults.py) kills only at a step's mid-point (after backward), so a
    failure that strikes while a save is landing takes effect at the next mid-point: the
    save is lost only if it lands after that. The window ``L - C`` in which the model loses
    a landing save is therefore whole steps: ``floor((L - C) / step) * step`` (0 when a save
    lands within one step, as here). A real failure strikes at once; the planner keeps
    ``L`` for that.
    """
    if costs.durable_s is None or costs.ckpt_cost_s is None or step_s <= 0:
        return None
    window = costs.durable_s - costs.ckpt_cost_s
    return costs.ckpt_cost_s + math.floor(window / step_s) * step_s


def first_steps_left_out(records: list[dict]) -> list[dict]:
    """Step records without each attempt's first step (its warm-up, the other ranks still
    starting: the plan counts that in the restart R or the first start-up S0)."""
    steps, opened = [], False
    for r in records:
        if r["type"] == "job_start":
            opened = True
        elif r["type"] == "step":
            if not opened:
                steps.append(r)
            opened = False
    return steps


def calibrate(run_dir: str, args: argparse.Namespace, wall: float) -> dict:
    """The costs an a-priori plan would be given: measured on a separate calibration run
    (same engine and settings, its own failures at fixed steps, none of the seeds' runs)."""
    from steadytrain.monitor.ledger import read_ledger
    from steadytrain.planning import measure_run

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    costs = measure_run(run_dir)
    steps = first_steps_left_out(records)
    compute = float(np.mean([r["step_s"] - r["checkpoint_block_s"] for r in steps]))
    return {
        "wall_s": wall,
        "steps": args.calibration_steps,
        "kill_at_steps": args.calibration_kills,
        "restarts": costs.interruptions,
        "compute_s_per_step": compute,
        "ckpt_block_s": costs.ckpt_cost_s,
        "ckpt_durable_s": landed_s(costs, compute),
        "restart_s": costs.restart_cost_s,
        "restart_exposed_s": costs.restart_exposed_s,
        "data_stall_frac": costs.data_stall_frac,
        "first_startup_s": costs.first_startup_s,
    }


def a_priori(cal: dict, args: argparse.Namespace) -> dict:
    """The planner's prediction before the run: the nominal failure rate (``--mtbf``) and
    the calibration run's costs, over a run of ``--steps`` steps with the calibration's
    first start-up: the run lasts W / G + S0 for W = steps x compute per step, so its
    goodput is W / (W / G + S0), G the long-run goodput (``goodput_exact``)."""
    from steadytrain.planning import goodput_exact

    tau = args.every * cal["compute_s_per_step"]
    g = goodput_exact(
        tau, cal["ckpt_block_s"], args.mtbf, restart_s=cal["restart_s"],
        durable_s=cal["ckpt_durable_s"], stall_frac=cal["data_stall_frac"],
        restart_exposed_s=cal["restart_exposed_s"],
    )  # fmt: skip
    work = args.steps * cal["compute_s_per_step"]
    return {"long_run": g, "run": work / (work / g + cal["first_startup_s"]), "interval_s": tau}


def measure(name: str, run_dir: str, args: argparse.Namespace, wall: float) -> dict:
    from steadytrain.monitor.goodput import compute_goodput
    from steadytrain.monitor.ledger import read_ledger
    from steadytrain.planning import goodput_exact, measure_run
    from steadytrain.planning.from_run import plan_from_run

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    b = compute_goodput(records)
    costs = measure_run(run_dir)
    steps = first_steps_left_out(records)
    compute = float(np.mean([r["step_s"] - r["checkpoint_block_s"] for r in steps]))
    tau = args.every * compute  # wall seconds of training between two saves
    # No failure seen: plan with (practically) none, not with the planner's default rate.
    rate = {} if costs.interruptions else {"mtbf_hours": 1e12}
    plan = plan_from_run(
        run_dir, measured=costs, days=b.total_s / 86400.0, interval_min=tau / 60.0,
        durable_s=landed_s(costs, compute), simulate_runs=0, **rate,
    )  # fmt: skip
    c, l_s, r = plan["ckpt_cost_s"], plan["durable_s"], plan["restart_cost_s"]
    s = plan["data_stall_frac"]
    pred = plan["goodput_exact_run"]  # the observed rate, the first start-up counted
    nominal = goodput_exact(tau, c, args.mtbf, restart_s=r, durable_s=l_s, stall_frac=s)
    out = {
        "name": name,
        "seed": args.seed,
        "wall_s": wall,
        "goodput_measured": b.goodput,
        "kept_steps_per_wall_s": b.steps_kept / b.total_s if b.total_s else 0.0,
        "goodput_predicted_exact": pred,
        "goodput_predicted_first_order": plan["goodput_run"],
        "goodput_predicted_nominal_mtbf": nominal,
        "failure_rate_ci": plan["failure_rate_ci"],
        "first_startup_s": plan["first_startup_s"],
        "observed_mtbf_s": (b.total_s / costs.interruptions) if costs.interruptions else None,
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
        f"[bench] {name} seed {args.seed}: goodput {b.goodput:.3f} measured, {pred:.3f} "
        f"predicted ({nominal:.3f} at the nominal MTBF); {b.attempts - 1} restarts, "
        f"{out['kept_steps_per_wall_s']:.2f} kept steps/s, C={c * 1e3:.0f} ms, "
        f"L={l_s * 1e3:.0f} ms, R={r:.1f} s, tau={tau:.2f} s",
        flush=True,
    )
    return out


# Two-sided 95 % Student t quantiles by degrees of freedom (no scipy here); 1.96 beyond 30.
_T95 = [12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def mean_ci(xs: list[float]) -> dict:
    """Mean and its 95 % t interval over seeds (min, median, max beside it)."""
    a = np.asarray(xs, dtype=float)
    m = float(a.mean())
    half = 0.0
    if a.size > 1:
        t = _T95[a.size - 2] if a.size - 2 < len(_T95) else 1.96
        half = t * float(a.std(ddof=1)) / np.sqrt(a.size)
    return {
        "mean": m, "ci95": [m - half, m + half], "n": int(a.size),
        "min": float(a.min()), "median": float(np.median(a)), "max": float(a.max()),
    }  # fmt: skip


def summarise(results: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["name"] for r in results):
        rs = [r for r in results if r["name"] == name]
        d = mean_ci([r["goodput_predicted_exact"] - r["goodput_measured"] for r in rs])
        prior = [r["goodput_a_priori"] for r in rs if r.get("goodput_a_priori") is not None]
        out[name] = {
            "measured": mean_ci([r["goodput_measured"] for r in rs]),
            "predicted": mean_ci([r["goodput_predicted_exact"] for r in rs]),
            "predicted_nominal_mtbf": mean_ci([r["goodput_predicted_nominal_mtbf"] for r in rs]),
            "predicted_minus_measured": d,
            "kept_steps_per_wall_s": mean_ci([r["kept_steps_per_wall_s"] for r in rs]),
            "within_2_points": abs(d["mean"]) <= 0.02,
        }
        if prior:  # one prediction per engine, set against every seed's measurement
            dp = mean_ci([r["goodput_a_priori"] - r["goodput_measured"] for r in rs])
            out[name]["a_priori"] = prior[0]
            out[name]["a_priori_minus_measured"] = dp
            out[name]["a_priori_within_2_points"] = abs(dp["mean"]) <= 0.02
        print(
            f"[bench] {name}: measured {out[name]['measured']['mean']:.3f}, predicted "
            f"{out[name]['predicted']['mean']:.3f}, difference {d['mean']:+.3f} "
            f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] over {d['n']} seed(s)",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    p.add_argument("--mtbf", type=float, default=30.0, help="mean time between failures (s)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=10, help="seeds (failure schedules) to run")
    p.add_argument(
        "--engines", default="async,torch_save", help="comma-separated: async, torch_save"
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "goodput_faults.json"))
    p.add_argument(
        "--calibration-steps", type=int, default=40,
        help="steps of the calibration run per engine (0: no a-priori prediction)",
    )  # fmt: skip
    p.add_argument(
        "--calibration-kills", default="10,25",
        help="steps at which the calibration run is killed (its restarts give R)",
    )  # fmt: skip
    p.add_argument(
        "--keep", default="", help="keep the run directories (ledgers) under this directory"
    )
    args = p.parse_args()
    engines = {
        "async": ("steadytrain async (DCP, thread)",
                  ["checkpoint.engine=dcp", "checkpoint.async_mode=thread"]),
        "torch_save": ("torch.save sync (rank 0, one file)", ["checkpoint.engine=torch_save"]),
    }  # fmt: skip
    chosen = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(chosen) - set(engines))
    if unknown or args.seeds < 1:
        raise SystemExit(f"--engines {unknown} unknown (use {sorted(engines)}) or --seeds < 1")
    first, results, calibration = args.seed, [], {}
    with contextlib.ExitStack() as stack:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            tmp = args.keep
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="goodput-faults-"))
        dataset = make_dataset(os.path.join(tmp, "ds"))
        kills = f"kill_at_steps={args.calibration_kills}"
        for key in chosen if args.calibration_steps else ():
            name, settings = engines[key]
            run_dir = os.path.join(tmp, f"calibration-{key}")
            wall = run(f"{name} calibration", run_dir, dataset, args, settings, kills,
                       args.calibration_steps)  # fmt: skip
            calibration[name] = calibrate(run_dir, args, wall)
            calibration[name]["prediction"] = a_priori(calibration[name], args)
            print(f"[bench] calibration {name}: {calibration[name]}", flush=True)
        for seed in range(first, first + args.seeds):
            args.seed = seed
            for key in chosen:  # the engines of one seed back to back: the same load
                name, settings = engines[key]
                run_dir = os.path.join(tmp, f"{key}-{seed}")
                got = run(name, run_dir, dataset, args, settings)
                if name in calibration:
                    got["goodput_a_priori"] = calibration[name]["prediction"]["run"]
                results.append(got)
    args.seed = first
    doc = {
        "benchmark": "goodput_faults",
        "settings": {
            "steps": args.steps,
            "every_steps": args.every,
            "mtbf_s": args.mtbf,
            "seeds": list(range(args.seed, args.seed + args.seeds)),
            "ranks": 2,
            "model": MODEL,
            "machine": f"{os.cpu_count()} CPU cores, gloo",
        },
        "command": "python bench/goodput_faults.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "load_average_end": os.getloadavg(),
        "labels": {
            "a_priori": "nominal failure rate (--mtbf), costs and first start-up from the "
            "separate calibration run: what the planner predicts before the run",
            "in_sample": "goodput_predicted_exact: the run's own measured costs, the failure "
            "rate it saw and its first start-up (a fit, not a prediction)",
            "nominal_mtbf_in_sample_costs": "goodput_predicted_nominal_mtbf: the nominal rate "
            "with the run's own costs, first start-up left out (the earlier JSON's figure)",
        },
        "calibration": calibration,
        "summary": summarise(results),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
