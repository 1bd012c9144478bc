"""Where the suite's CPU goes: a pytest plugin, and its summary.

    PYTHONPATH=scripts ./run.sh test -p suite_cpu          # writes .suite-cpu/<worker>.jsonl
    python scripts/suite_cpu.py [.suite-cpu] [--top 40]    # per folder, per file, per test
    python scripts/suite_cpu.py [.suite-cpu] --workers     # per worker: when it ended, its tail

The suite runs on 2 cores with 4 workers and keeps both busy, so its wall time follows its
CPU, not its tests' durations (a test's duration counts the other workers' load too).
Around each test the plugin sums user + system CPU of the worker and of every process
below it, each with the CPU of the children it reaped (``psutil``): a rank that ended
during the test is counted once, by its parent's reaped-children time. What it misses:
processes reparented away from the worker (a daemon that double-forks). A session fixture's
set-up is counted in the test that first asked for it; background work started by a fixture
(the node lane's incident replays) is counted in whichever tests run beside it on its worker.
``SUITE_CPU_DIR`` sets the output directory (default ``.suite-cpu``, emptied by nobody:
remove it before a new run).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

OUT = os.environ.get("SUITE_CPU_DIR", ".suite-cpu")


def tree_cpu() -> float:
    """User + system CPU seconds of this process and every live descendant, reaped children
    included."""
    me = psutil.Process()
    try:
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        procs = [me]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue  # ended between the listing and the read: its parent counts it next time
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu0, wall0 = tree_cpu(), time.monotonic()
    yield
    row = {
        "id": item.nodeid,
        "cpu_s": round(tree_cpu() - cpu0, 2),
        "wall_s": round(time.monotonic() - wall0, 2),
        "load_1m": round(os.getloadavg()[0], 1),
    }
    os.makedirs(OUT, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(OUT, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def summarise(rows: list[dict[str, Any]], top: int) -> str:
    def table(title: str, key: Any) -> list[str]:
        cpu: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for r in rows:
            cpu[key(r["id"])] += r["cpu_s"]
            count[key(r["id"])] += 1
        lines = [f"\n{title}", f"{'CPU s':>8} {'share':>6} {'tests':>6}  where"]
        for name, s in cpu.most_common(top):
            lines.append(f"{s:8.0f} {100 * s / total:5.1f}% {count[name]:6d}  {name}")
        return lines

    total = sum(r["cpu_s"] for r in rows) or 1.0
    out = [f"{len(rows)} tests, {total:.0f} s of CPU (user + system, every descendant)"]
    out += table("by folder", lambda i: "/".join(i.split("::")[0].split("/")[:2]))
    out += table("by file", lambda i: i.split("::")[0])
    out += table("by test", lambda i: i)
    return "\n".join(out)


def workers(by_worker: dict[str, list[dict[str, Any]]]) -> str:
    """Per worker, its rows in the order it ran them: when its last test ended (its tests'
    wall times summed, from its first test's start: collection not counted), its longest
    test and when that started, and its last test. A run whose workers end far apart, or
    whose longest test started late, lost wall time to its order, not to its CPU."""
    out = [
        f"{'worker':<8} {'tests':>6} {'CPU s':>7} {'ends s':>7}  longest test (wall s, started at s); last test"
    ]
    for name in sorted(by_worker):
        rows, t, longest = by_worker[name], 0.0, (0.0, 0.0, "")
        for r in rows:
            if r["wall_s"] > longest[0]:
                longest = (r["wall_s"], t, r["id"])
            t += r["wall_s"]
        cpu = sum(r["cpu_s"] for r in rows)
        last = rows[-1] if rows else {"wall_s": 0.0, "id": ""}
        out.append(
            f"{name:<8} {len(rows):6d} {cpu:7.0f} {t:7.0f}  {longest[2]} ({longest[0]:.1f}, "
            f"{longest[1]:.0f}); {last['id']} ({last['wall_s']:.1f})"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", default=OUT)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--workers", action="store_true", help="per worker: its end and its tail")
    args = ap.parse_args()
    by_worker = {
        os.path.basename(f).removesuffix(".jsonl"): [json.loads(line) for line in open(f)]
        for f in glob.glob(os.path.join(args.dir, "*.jsonl"))
    }
    rows = [r for rs in by_worker.values() for r in rs]
    if not rows:
        raise SystemExit(f"{args.dir}: no *.jsonl rows (run the suite with -p suite_cpu first)")
    print(workers(by_worker) if args.workers else summarise(rows, args.top))


if __name__ == "__main__":
    main()
