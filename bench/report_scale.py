"""Benchmark: `steadytrain report` time and peak memory against run length and rank count.

Each cell of a grid (ranks x steps, default {64, 256, 1024} x {1000, 10000}) is a run
directory holding what a finished run of that size leaves behind:

* ``ledger.jsonl``: rank 0's ledger, written by a real ``GoodputMeter`` fed ``steps`` steps
  of 0.2 s on a synthetic clock (``steadytrain.testing.synthetic``; a checkpoint every 100);
* ``ranks/rank-RRRRR.jsonl`` for every rank, each ``steps`` records long, with the snapshot
  the real writer leaves at the end of a run. One template file is written by the real
  ``RankFile``; every rank's file is a copy with its own ``rank_start`` line, and its
  snapshot is written by the real ``write_snapshot_of`` over that file (inode and tail
  checks included), so the reader does exactly what it does on a real run. 1,024 ranks x
  10,000 steps is about 3.5 GB of rank files.

Every report runs in a fresh process (``steadytrain report RUN --json``); its wall time and
peak RSS (``ru_maxrss``) are recorded. Cells run in rotating order, ``--reps`` times, and
each is reported as min/median/max. The claim to check: time and memory flat in steps, and
linear in ranks.

    .venv/bin/python bench/report_scale.py [--ranks 64,256,1024] [--steps 1000,10000] [--reps 3]

Writes bench/results/report_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "report_scale.json")
CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from steadytrain.report.build import build_report
s = build_report(sys.argv[1], sys.argv[2])
print(json.dumps({"build_s": time.perf_counter() - t0, "ranks": len(s["ranks"]),
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def rank_step(step: int, rank: int) -> dict:
    slow = rank == 3 and step % 7 == 0  # one mildly irregular rank, so the plots have content
    return {
        "type": "rank_step", "step": step, "attempt": 0, "t": 1.8e9 + 0.2 * step,
        "step_s": 0.2, "data_wait_s": 0.05 if slow else 0.002, "between_next_s": 0.19,
        "compute_s": 0.19, "forward_s": 0.06, "checkpoint_block_s": 0.0,
        "read_p99_s": 0.004, "bytes_read": 65536, "cache_hits": 1, "cache_misses": 0,
        "rss_bytes": 2_000_000_000 + step, "shm_bytes": 1 << 20,
    }  # fmt: skip


def make_cell(root: str, ranks: int, steps: int) -> str:
    from steadytrain.monitor.ledger import write_snapshot_of
    from steadytrain.monitor.meter import GoodputMeter, MeterConfig
    from steadytrain.monitor.ranks import RankFile, RankSummary, rank_path, rank_snapshot_path
    from steadytrain.testing.synthetic import Timeline, feed

    run = os.path.join(root, f"r{ranks}-s{steps}")
    os.makedirs(run)
    meter = GoodputMeter(run, rank=0, world_size=ranks, config=MeterConfig(per_rank=False))
    tl = Timeline()  # the records' clock is given (0.2 s steps), not the bench's speed
    tl.job_start(startup_s=5.0, world_size=ranks, attempt=0)
    for s in range(1, steps + 1):
        tl.step(s, tokens=ranks * 4096, data_wait_s=0.002, compute_s=0.198)
        if s % 100 == 0:
            tl.event({"type": "checkpoint", "step": s, "block_s": 0.01, "durable_s": 0.5,
                      "ok": True, "path": f"ckpt/{s}", "error": None})  # fmt: skip
    feed(meter, tl.anchored())
    meter.close()
    # The template: one real rank file (body only), then one copy per rank.
    tdir = os.path.join(root, "template")
    shutil.rmtree(tdir, ignore_errors=True)
    rf = RankFile(tdir, 0, snapshot_every=1000)
    for lo in range(1, steps + 1, 1000):
        rf.write([rank_step(s, 0) for s in range(lo, min(steps, lo + 999) + 1)])
    rf.close()
    body = open(rank_path(tdir, 0), "rb").read()
    template = rf.summary
    for r in range(ranks):
        node = f"node-{r // 8:03d}"
        start = {"type": "rank_start", "t": 1.8e9, "attempt": 0, "rank": r, "node": node,
                 "local_rank": r % 8, "world_size": ranks, "device": "cpu", "pid": 1000 + r}  # fmt: skip
        end = {"type": "rank_end", "t": 1.8e9 + 0.2 * steps, "attempt": 0, "step": steps,
               "reason": "finished"}  # fmt: skip
        path = rank_path(run, r)
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.write(json.dumps(start).encode() + b"\n" + body + json.dumps(end).encode() + b"\n")
            size = f.tell()
        summary = RankSummary.from_state_dict(template.state_dict())
        summary.rank, summary.node, summary.nodes = r, node, [node]
        summary.add(start)
        summary.add(end)
        write_snapshot_of(path, rank_snapshot_path(run, r), size, {"summary": summary.state_dict()})
    shutil.rmtree(tdir, ignore_errors=True)
    return run


def run_report(run: str, out: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, run, out], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"report failed on {run}:\n{p.stderr[-4000:]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **got}


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--steps", default="1000,10000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", help="where to build the run directories (default: a temp dir)")
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    root = tempfile.mkdtemp(prefix="report-scale-", dir=args.dir)
    try:
        cells = {}
        for r in ranks:
            for s in steps:
                t0 = time.perf_counter()
                cells[(r, s)] = make_cell(root, r, s)
                print(f"built {r} ranks x {s} steps in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)  # fmt: skip
        keys = list(cells)
        runs: dict[tuple[int, int], list[dict]] = {k: [] for k in keys}
        for rep in range(args.reps):  # rotating order: each rep starts one cell later
            order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
            for k in order:
                runs[k].append(run_report(cells[k], os.path.join(root, "out")))
                assert runs[k][-1]["ranks"] == k[0]
                print(f"{k}: {runs[k][-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = []
    for (r, s), xs in runs.items():
        table.append({
            "ranks": r, "steps": s,
            "wall_s": spread([x["wall_s"] for x in xs]),
            "build_s": spread([x["build_s"] for x in xs]),
            "peak_rss_mib": spread([x["maxrss_kib"] / 1024 for x in xs]),
        })  # fmt: skip
    res = {
        "benchmark": "report_scale",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": os.getloadavg(),
        "reps": args.reps,
        "cells": table,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(res, f, indent=2)
    json.dump(res, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
