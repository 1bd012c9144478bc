"""Benchmark: how long a hung rank holds the job with the hang watchdog, against the backend.

Each repetition runs the real ``steadytrain train`` under ``torchrun`` (2 ranks, CPU, gloo,
``--max-restarts 1``) with rank 1 blocked forever before the step's loss all-reduce (the
``hang_at_step`` fault), and reads from the ledger, all from the last step record before the
hang (the last progress):

- ``detect_s``: to the watchdog's detection (the ``hang`` record's ``detect_t``);
- ``kill_s``: to rank 0's exit decision, after the verdicts and the ledger record
  (``kill_t``);
- ``restart_s``: to the next attempt's process start (``job_start.t - startup_s -
  restore_s``): what the issue bounds by 2x the configured detection time.

The baseline is the backend's own collective timeout, read from the installed torch
(``torch.distributed.constants``: gloo 30 min; NCCL 10 min, its documented default). It is
the documented default, not measured: waiting 30 min per repetition proves nothing more, and
gloo cannot abort the pending collective even then. Also measured: the hot-path cost of
``beat()`` and of a ``phase()`` block (the loop pays both every step).

    .venv/bin/python bench/hang_detect.py [--reps 3] [--floor 5]

Writes bench/results/hang_detect.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "e2e", "train"))

from harness import ledger, make_dataset, run_torchrun  # noqa: E402

from steadytrain.monitor.watchdog import HangWatchdog, WatchdogConfig, backend_timeout_s  # noqa: E402

HANG_STEP = 10


def one_run(dataset: str, run_dir: str, floor_s: float) -> dict[str, float]:
    settings = [
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        "train.max_steps=12",
        f"monitor.watchdog.floor_s={floor_s}",
        "monitor.watchdog.poll_s=0.25",
        "monitor.watchdog.grace_s=5",
        "monitor.watchdog.warmup_steps=3",
        "monitor.watchdog.init_s=60",
    ]
    run_torchrun(
        2, settings, faults=f"hang_at_step={HANG_STEP};hang_rank=1", max_restarts=1, timeout=180
    )
    recs = ledger(run_dir)
    (hang,) = [r for r in recs if r["type"] == "hang"]
    start = [r for r in recs if r["type"] == "job_start"][1]
    last = max(r["t"] for r in recs if r["type"] == "step" and r["t"] < start["t"])
    restart_t = start["t"] - start["startup_s"] - start["restore_s"]
    assert hang["stuck_ranks"] == [1], hang
    return {
        "deadline_s": hang["deadline_s"],
        "detect_s": hang["detect_t"] - last,
        "kill_s": hang["kill_t"] - last,
        "restart_s": restart_t - last,
    }


def hot_path_ns(n: int = 200_000) -> dict[str, float]:
    wd = HangWatchdog(tempfile.gettempdir(), config=WatchdogConfig(enabled=False))
    step = iter(range(10**9))
    beat = min(timeit.repeat(lambda: wd.beat(next(step)), number=n, repeat=5)) / n
    ph = wd.phase("checkpoint")

    def block() -> None:
        with ph:
            pass

    phase = min(timeit.repeat(block, number=n, repeat=5)) / n
    return {"beat_ns": beat * 1e9, "phase_block_ns": phase * 1e9}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--floor", type=float, default=5.0, help="monitor.watchdog.floor_s")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hang-detect-") as base:
        dataset = make_dataset(os.path.join(base, "ds"))
        runs = [
            one_run(dataset, os.path.join(base, f"run{i}"), args.floor) for i in range(args.reps)
        ]
    out = {
        "ranks": 2,
        "backend": "gloo (CPU)",
        "reps": args.reps,
        "floor_s": args.floor,
        "runs": runs,
        **{k: spread([r[k] for r in runs]) for k in ("detect_s", "kill_s", "restart_s")},
        "restart_over_deadline": spread([r["restart_s"] / r["deadline_s"] for r in runs]),
        "baseline_gloo_timeout_s": backend_timeout_s("gloo"),
        "baseline_nccl_timeout_s": backend_timeout_s("nccl"),
        "baseline_note": "torch's default collective timeouts (documented), not measured",
        "hot_path": hot_path_ns(),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hang_detect.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
