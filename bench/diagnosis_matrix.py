"""Benchmark: the diagnosis matrix's precision and recall (issue 26, item 6).

Runs every case of ``steadytrain.testing.incidents.matrix`` on one node harness: each kind
alone (storage, loader-memory, node-loss, hang, data-order), two kinds at once on different
nodes, storage on 2 of 3 nodes, a CPU-quota straggler (one node held to a twentieth of a core),
an evaluation-heavy clean run, and ``--clean`` clean multi-node runs (alternating 2 and 3
nodes), one after another. The faults are injected by the harness; the incidents are
``steadytrain report --json``'s alone (steadytrain.diagnose). Each case's incidents are
paired with what was injected (``expect.check``: kind, nodes, ranks, step range):

- precision: incidents that match an injected fault / incidents reported;
- recall: injected faults found / faults injected;
- per kind, and the clean runs' false alarms.

The machine is shared (2 cores, other test runs beside it): that is the point of the clean
runs, whose false alarms count against precision. Case times are reported as spreads.

    .venv/bin/python bench/diagnosis_matrix.py [--clean 10] [--cases storage,hang,...]

Writes bench/results/diagnosis_matrix.json (``--out``); run directories stay under
``--workdir`` (default: a temporary directory, removed unless ``--keep``). ``--add FILE``
also counts the cases of an earlier result (cases run apart, e.g. one case rerun).
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
from collections import Counter
from typing import Any

from steadytrain.testing.incidents.expect import score
from steadytrain.testing.incidents.matrix import CASES, CLEAN_CASES, run_cases

HERE = os.path.dirname(os.path.abspath(__file__))
# Every case once (the evaluation-heavy clean run included); the plain clean runs repeat.
FAULT_CASES = [n for n in CASES if n not in CLEAN_CASES]


def per_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Precision and recall per incident kind, from ``case_row`` rows (a wrong-node incident
    is a miss of its expected kind and a false alarm of its own)."""
    tp: Counter[str] = Counter(k for r in rows for k, _ in r["found"])
    fn: Counter[str] = Counter(m["kind"] for r in rows for m in r["missed"])
    fp: Counter[str] = Counter(str(i["kind"]) for r in rows for i in r["false"])
    out = {}
    for k in sorted(set(tp) | set(fn) | set(fp)):
        out[k] = {
            "found": tp[k],
            "missed": fn[k],
            "false": fp[k],
            "precision": tp[k] / (tp[k] + fp[k]) if tp[k] + fp[k] else None,
            "recall": tp[k] / (tp[k] + fn[k]) if tp[k] + fn[k] else None,
        }
    return out


def row_score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``expect.score`` over ``case_row`` rows."""
    checks = [{"matched": r["found"], "missed": r["missed"], "extra": r["false"]} for r in rows]
    return score(checks)


def case_row(c: dict[str, Any], workdir: str) -> dict[str, Any]:
    """One case, briefly: what was injected, what the report found, missed and added."""
    ch = c["check"]
    err = c.get("error")
    return {
        "case": c["case"],
        "seconds": c.get("seconds"),
        "error": err.replace(workdir, "WORKDIR") if err else None,
        "injected": [[e["kind"], e["nodes"]] for e in c["expected"]],
        "found": [[e["kind"], e["nodes"]] for e, _ in ch["matched"]],
        "missed": [
            {
                "kind": m["expected"]["kind"],
                "nodes": m["expected"]["nodes"],
                "near": [f"{n['incident']}: {'; '.join(n['problems'])}" for n in m["closest"]],
            }
            for m in ch["missed"]
        ],
        "false": [
            {k: i.get(k) for k in ("kind", "nodes", "ranks", "first_step", "last_step")}
            for i in ch["extra"]
        ],
        "report_incidents": [
            {k: i.get(k) for k in ("kind", "nodes", "ranks", "first_step", "last_step", "lost_s")}
            for i in c["incidents"]
        ],
        # what the report charged to slower ranks (a straggler's cost leaves goodput)
        "goodput": c.get("goodput"),
        "badput_s": c.get("badput_s") or {},
    }


def spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _git_rev() -> str | None:
    r = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
    )
    return r.stdout.strip() or None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(FAULT_CASES), help="cases, comma-separated")
    p.add_argument("--clean", type=int, default=10, help="clean multi-node runs (default 10)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--out", default=os.path.join(HERE, "results", "diagnosis_matrix.json"))
    p.add_argument(
        "--add", action="append", default=[], help="also count the cases of an earlier result"
    )
    args = p.parse_args()
    names = [n for n in args.cases.split(",") if n]
    # Clean runs interleaved with the fault cases, so that both see the same machine.
    clean = [CLEAN_CASES[i % len(CLEAN_CASES)] for i in range(args.clean)]
    order: list[str] = []
    while names or clean:
        if names:
            order.append(names.pop(0))
        if clean:
            order.append(clean.pop(0))
    workdir = args.workdir or tempfile.mkdtemp(prefix="diagnosis-matrix-")
    t0 = time.time()
    out = run_cases(order, workdir, log=lambda m: print(m, file=sys.stderr, flush=True))
    rows = [case_row(c, workdir) for c in out["cases"]]
    added = []
    for path in args.add:  # rows of earlier runs of this benchmark (cases run apart)
        with open(path) as f:
            earlier = json.load(f)
        rows += earlier["cases"]
        added.append({"command": earlier.get("command"), "started": earlier.get("started"),
                      "git": earlier.get("git"), "cases": len(earlier["cases"]),
                      "seconds": earlier.get("seconds")})  # fmt: skip
    fault = [r for r in rows if r["injected"]]
    clean_runs = [r for r in rows if not r["injected"]]
    result = {
        # No local path in a committed result: the command without --workdir/--out.
        "command": f"python bench/diagnosis_matrix.py --clean {args.clean}"
        + (f" --cases {args.cases}" if args.cases != ",".join(FAULT_CASES) else ""),
        "added": added,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "git": _git_rev(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "harness_mode": out["mode"],
        "score": row_score(rows),
        "score_fault_cases": row_score(fault),
        "per_kind": per_kind(rows),
        "clean_runs": {
            "runs": len(clean_runs),
            "with_false_alarms": sum(1 for r in clean_runs if r["false"]),
            "false_alarms": sum(len(r["false"]) for r in clean_runs),
            "failed": sum(1 for r in clean_runs if r.get("error")),
        },
        "case_seconds": spread([r["seconds"] for r in rows if r.get("seconds") is not None]),
        "cases": rows,
        "leftovers": [str(x).replace(workdir, "WORKDIR") for x in out["leftovers"]],
        "seconds": out["seconds"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    s = result["score"]
    print(
        f"precision {s['precision']:.2f}, recall {s['recall']:.2f} "
        f"({s['true_positives']} found, {s['false_negatives']} missed, "
        f"{s['false_positives']} false) over {len(rows)} runs; clean runs with a false "
        f"alarm: {result['clean_runs']['with_false_alarms']}/{len(clean_runs)}"
    )
    for row in result["cases"]:
        print(
            f"  {row['case']:24s} injected {row['injected']} found {row['found']} "
            f"missed {[m['kind'] for m in row['missed']]} false "
            f"{[(i['kind'], i['nodes']) for i in row['false']]}"
            + (f" ERROR {row['error'][:120]}" if row["error"] else "")
        )
    print(f"wrote {args.out}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
