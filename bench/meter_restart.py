"""Benchmark: a restarting job's meter start-up, with and without the ledger snapshot.

Writes a real ledger through ``GoodputMeter`` (one attempt of ``--steps`` steps with a
checkpoint commit every ``--every`` steps, then a crashed attempt of 37 steps), then times
constructing a new ``GoodputMeter`` on that run directory -- what every restart pays before
its first step -- twice per repetition, interleaved: from the snapshot
(``ledger.snapshot.json``, the default) and from a full re-read of the ledger (snapshot moved
aside). Both must give the same goodput; the records parsed show that start-up from the
snapshot does not grow with the number of steps.

    .venv/bin/python bench/meter_restart.py [--steps 100000] [--every 100] [--reps 5]

Writes bench/results/meter_restart.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

from steadytrain.monitor.ledger import SNAPSHOT_NAME
from steadytrain.monitor.meter import GoodputMeter


def write_run(run_dir: str, steps: int, every: int) -> None:
    meter = GoodputMeter(run_dir, memory_every=1000)
    meter.job_start()
    for s in range(1, steps + 1):
        meter.step(s, tokens=4096, data_wait_s=0.001, compute_s=0.05, loss=2.0)
        if s % every == 0:
            meter.event(
                {
                    "type": "checkpoint",
                    "step": s,
                    "block_s": 0.01,
                    "durable_s": 0.2,
                    "ok": True,
                    "path": f"ckpt/step-{s:08d}",
                    "error": None,
                }
            )
    meter.close()
    # A second attempt that resumes, runs 37 steps past its checkpoint and stops.
    meter = GoodputMeter(run_dir)
    meter.job_start(restored_step=steps)
    for s in range(steps + 1, steps + 38):
        meter.step(s, tokens=4096, data_wait_s=0.001, compute_s=0.05, loss=2.0)
    meter.close(reason="preempted")


def start_once(run_dir: str) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    meter = GoodputMeter(run_dir)
    dt = time.perf_counter() - t0
    result = (dt, meter.records_replayed, meter.breakdown().goodput)
    meter.close(reason="bench")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # synthetic steps trip the throughput alerts
    base = tempfile.mkdtemp(prefix="meter-restart-")
    run = os.path.join(base, "run")
    write_run(run, args.steps, args.every)
    snap = os.path.join(run, SNAPSHOT_NAME)
    aside = snap + ".aside"
    rows: dict[str, list[tuple[float, int, float]]] = {"snapshot": [], "full_read": []}
    # The snapshot is bound to the ledger file itself (inode, size, tail bytes), so both
    # modes start on the same run directory; each start appends one job_end record.
    for rep in range(args.reps):
        for mode in ("snapshot", "full_read") if rep % 2 == 0 else ("full_read", "snapshot"):
            if mode == "full_read":
                os.replace(snap, aside)
            try:
                rows[mode].append(start_once(run))
            finally:
                if mode == "full_read" and os.path.exists(aside):
                    os.replace(aside, snap)
    assert os.path.exists(snap), "the meter wrote no snapshot"
    out = {"steps": args.steps, "every": args.every, "reps": args.reps}
    for mode, rs in rows.items():
        out[mode] = {
            "startup_s_median": statistics.median(r[0] for r in rs),
            "records_parsed": rs[0][1],
            "goodput": rs[0][2],
        }
    assert out["snapshot"]["records_parsed"] < out["full_read"]["records_parsed"], out
    out["speedup"] = out["full_read"]["startup_s_median"] / out["snapshot"]["startup_s_median"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "meter_restart.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
