"""Today's whole restart, phase by phase: the baseline an in-place recovery is held against.

One job under the real ``torchrun`` (2 ranks by default, CPU, gloo, ``--max-restarts``
= the number of faults, c10d rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), whose
worker (``bench/_restart_worker.py``) faults once per attempt, ``--faults`` times per mode:

- ``kill``: a SIGKILLed rank (rank 1, mid-step);
- ``sigterm``: a rank blocked in a collective (rank 0 in the gradient all-reduce while rank
  1 makes no progress) that gets SIGTERM.

Per fault: the time from the kill (the faulting rank's own clock, written just before it,
``RUN_DIR/faults.jsonl``) to the job's next productive step (the next attempt's first step
record), and the report's restart phases (``report/restarts.py``: detection, teardown,
relaunch, imports, build, group, set-up, restore, the first step's excess; the part of
detection before the kill is ``before_kill_s``). Median, min and max over the faults.

``measure(mode, ...)`` is the reusable part: the in-place recovery bench calls it with its
own mode and worker and sets its rows beside these.

    .venv/bin/python bench/restart_phases.py [--faults 5] [--modes kill,sigterm]
        [--nproc 2] [--monitor-interval 0.1] [--keep DIR]

Writes bench/results/restart_phases.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_restart_worker.py")


def torchrun(nproc: int, restarts: int, monitor_interval: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--monitor-interval={monitor_interval}",
    ]


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    mode: str,
    *,
    faults: int = 5,
    nproc: int = 2,
    monitor_interval: float = 0.1,
    worker: str = WORKER,
    extra: list[str] | None = None,
    keep: str | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """One job of ``faults`` faults of ``mode``; per fault the kill -> next productive step
    time and the report's phases, and their median/min/max. ``worker``/``extra``: another
    job (it must write ``RUN_DIR/faults.jsonl`` as ``_restart_worker.py`` does)."""
    from steadytrain.monitor.ledger import read_ledger
    from steadytrain.report.build import build_report

    root = keep or tempfile.mkdtemp(prefix="restart-phases-")
    run_dir = os.path.join(root, f"run-{mode}-{nproc}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = torchrun(nproc, faults, monitor_interval) + [worker, "--run-dir", run_dir]
    cmd += ["--mode", mode, "--faults", str(faults), "--steps", str(10 + 5 * faults)]
    cmd += extra or []
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        kills = {r["attempt"]: r["t"] for r in map(json.loads, f)}
    ledger = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    first_step: dict[int, float] = {}
    attempt = -1
    for r in ledger:
        if r["type"] == "job_start":
            attempt = r["attempt"]
        elif r["type"] == "step" and not r.get("recovered"):
            first_step.setdefault(attempt, r["t"])
    rep = build_report(run_dir, os.path.join(run_dir, "report"))
    rows = []
    for row in rep["restart_phases"]:
        failed = row["after"]
        if failed not in kills or row["attempt"] not in first_step:
            continue
        phases = dict(row["phases"])
        last_progress = first_step[row["attempt"]] - row["wall_s"]
        rows.append(
            {
                "attempt": row["attempt"],
                "kill_to_productive_s": first_step[row["attempt"]] - kills[failed],
                "before_kill_s": kills[failed] - last_progress,
                "wall_s": row["wall_s"],
                "steady_step_s": row["steady_step_s"],
                "phases": phases,
            }
        )
    names = sorted(
        {k for r in rows for k in r["phases"]},
        key=lambda k: list(rows[0]["phases"]).index(k) if k in rows[0]["phases"] else 99,
    )
    out = {
        "mode": mode,
        "nproc": nproc,
        "faults": len(rows),
        "monitor_interval_s": monitor_interval,
        "job_wall_s": wall,
        "goodput": rep["goodput"],
        "kill_to_productive_s": _spread([r["kill_to_productive_s"] for r in rows]),
        "phases": {k: _spread([r["phases"].get(k, 0.0) for r in rows]) for k in names},
        "before_kill_s": _spread([r["before_kill_s"] for r in rows]),
        "rows": rows,
        "run_dir": run_dir if keep else None,
    }
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--modes", default="kill,sigterm")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--monitor-interval", type=float, default=0.1)
    p.add_argument("--keep", default=None, help="keep the run directories under DIR")
    p.add_argument("--out", default=os.path.join(HERE, "results", "restart_phases.json"))
    args = p.parse_args()
    results = {
        "load_average_start": os.getloadavg(),
        "command": " ".join(["bench/restart_phases.py", *sys.argv[1:]]),
        "modes": {},
    }
    for mode in args.modes.split(","):
        r = measure(
            mode,
            faults=args.faults,
            nproc=args.nproc,
            monitor_interval=args.monitor_interval,
            keep=args.keep,
        )
        results["modes"][mode] = r
        k = r["kill_to_productive_s"]
        print(
            f"{mode}: kill -> next productive step median {k['median']:.2f} s "
            f"({k['min']:.2f}-{k['max']:.2f}) over {r['faults']} faults",
            flush=True,
        )
        for name, s in r["phases"].items():
            print(f"  {name:<22} {s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})")
    results["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
