"""What the demo's two recoveries cost, as a share of its wall time (issue 44: under 5 %).

    python bench/demo_recoveries.py --rounds 3 [--baseline-src OLD/src] [--out FILE]

Runs ``steadytrain demo --json`` ``--rounds`` times with this checkout's code and, with
``--baseline-src``, as many times with another checkout's ``src`` (e.g. an exported older
commit), interleaved (baseline, this, baseline, ...). For each run: the report's restart
phases (``report.json`` ``restart_phases``: from the failed attempt's last progress to the
next attempt's first productive step, phase by phase) summed over the recoveries, as a
share of the report's ``total_s``; each recovery's first-step excess; the load average
before and after. ``--summarise RUN_DIR...`` prints the same for runs already made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def share(run_dir: str | Path) -> dict:
    """The recoveries' seconds and share of the run, from its report."""
    rep = json.loads((Path(run_dir) / "report" / "report.json").read_text())
    rows = rep["restart_phases"]
    total = sum(r["wall_s"] for r in rows)
    return {
        "run_dir": str(run_dir),
        "recoveries": len(rows),
        "recoveries_s": round(total, 3),
        "total_s": round(rep["total_s"], 3),
        "share": round(total / rep["total_s"], 4),
        "each_s": [round(r["wall_s"], 3) for r in rows],
        "first_step_excess_s": [round(r["phases"].get("first_step_excess_s", 0), 3) for r in rows],
        "phases_s": [{k: round(v, 3) for k, v in r["phases"].items()} for r in rows],
        "goodput": rep["goodput"],
    }


def run_demo(src: Path, run_dir: Path) -> dict:
    load0 = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "steadytrain.cli", "demo", "--run-dir", str(run_dir), "--json"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
    return {**share(run_dir), "load_before": load0, "load_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src directory")
    ap.add_argument("--work", type=Path, help="where the runs go (default: a temp directory)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "demo_recoveries.json")
    ap.add_argument("--summarise", nargs="+", metavar="RUN_DIR", help="report runs made")
    args = ap.parse_args()
    if args.summarise:
        for d in args.summarise:
            print(json.dumps(share(d)))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="demo-recoveries-"))
    sides = [("this", SRC)] + ([("baseline", args.baseline_src)] if args.baseline_src else [])
    runs: list[dict] = []
    for i in range(args.rounds):
        for label, src in sides[::-1] if i % 2 else sides:  # alternate who goes first
            r = {"label": label, "round": i, **run_demo(src, work / f"{label}{i}")}
            print(json.dumps(r), flush=True)
            runs.append(r)
    summary = {label: sorted(r["share"] for r in runs if r["label"] == label) for label, _ in sides}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"t": time.time(), "shares": summary, "runs": runs}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
