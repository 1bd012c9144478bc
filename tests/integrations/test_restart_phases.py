"""The restart ledger on a real restart (issue 44 section 1): ``plain_worker.py`` under the
real torchrun, 2 gloo ranks, rank 1 SIGKILLed mid-step 7, ``--max-restarts 1``.

The report's phases of the restart (detection, teardown, relaunch, imports, build, group,
set-up, restore, the first step's excess) plus one steady step must add up, within 5 %, to
the restart's wall time measured here from the raw records alone: the newest progress
record of attempt 0 on any rank (rank 0's ledger and every rank file) to attempt 1's first
step record. Each phase the records can show is there and >= 0, the start-up phases add up
to the ``job_start``'s own ``startup_s``, the crash incident carries its restart, and the
text and HTML reports show it.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys

import pytest
from example_runs import finish
from harness import env, start_agent

from steadytrain.monitor.ledger import read_ledger
from steadytrain.report.restarts import STEADY_STEPS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_worker.py")
STEPS = 14


def _jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a torn line of the killed rank
    return out


def test_restart_phases_add_up_to_the_restart(dataset: str, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    cmd += ["--monitor-interval=0.2", WORKER, "--data", dataset, "--run-dir", run_dir]
    cmd += ["--steps", str(STEPS), "--every", "4", "--crash-at-step", "7"]
    proc = start_agent(cmd, env())
    finish(proc)

    # -- the restart's wall time, from the raw records ----------------------------------------
    ledger = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    starts = [i for i, r in enumerate(ledger) if r["type"] == "job_start"]
    assert len(starts) == 2, [r["type"] for r in ledger]
    first = ledger[starts[0] : starts[1]]
    progress = [r["t"] for r in first if r["type"] in ("step", "checkpoint")]
    for path in glob.glob(os.path.join(run_dir, "ranks", "rank-*.jsonl")):
        progress += [
            r["t"] for r in _jsonl(path) if r.get("type") == "rank_step" and r.get("attempt") == 0
        ]
    second = [r for r in ledger[starts[1] :] if r["type"] == "step" and not r.get("recovered")]
    steady = statistics.median(r["step_s"] for r in second[1 : 1 + STEADY_STEPS])
    wall = second[0]["t"] - max(progress)
    assert wall > 0

    # -- the report's phases ------------------------------------------------------------------
    r = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "report", run_dir, "--json", "--no-plots"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    (row,) = rep["restart_phases"]
    phases = row["phases"]
    # rank 0 recorded the failure (gloo's "Connection reset by peer"): the gap is divided
    for name in ("detection_s", "teardown_s", "relaunch_s", "imports_s", "build_s"):
        assert name in phases, phases
    for name in ("group_s", "setup_s", "restore_s", "first_step_excess_s"):
        assert name in phases, phases
    assert "undivided_s" not in phases and "startup_s" not in phases, phases
    assert all(v >= 0 for v in phases.values()), phases
    assert phases["relaunch_s"] > 0 and phases["imports_s"] > 0, phases
    total = sum(phases.values()) + steady
    assert abs(total - wall) <= 0.05 * wall, (total, wall, phases, steady)
    assert abs(row["wall_s"] - wall) <= 0.05 * wall, (row, wall)

    # the start-up phases are job_start's startup_s, split
    for i in starts:
        js = ledger[i]
        split = js["startup_phases"]
        assert abs(sum(split.values()) - js["startup_s"]) < 1e-6, js

    # the crash's incident carries its restart
    crash = [i for i in rep["incidents"] if i.get("attempt") == 0]
    assert crash and crash[0]["restart"]["wall_s"] == row["wall_s"], rep["incidents"]

    # text and HTML
    r = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "report", run_dir],
        capture_output=True,
        text=True,
        env=env(),
        timeout=180,
    )
    assert "restart into attempt 1:" in r.stdout and "relaunch" in r.stdout, r.stdout
    assert "attempt 0 start-up: imports" in r.stdout, r.stdout
    assert "  its restart: " in r.stdout, r.stdout  # under the crash's incident
    html = open(rep["html"], encoding="utf-8").read()
    assert html.count('<div class="restart">') == 1 and "Restarts, phase by phase" in html
