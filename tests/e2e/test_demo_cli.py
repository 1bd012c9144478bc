"""`steadytrain demo --json` end to end, reduced in size (corpus and steps).

Compares the JSON the command prints with the run's own files: it tokenized and verified the
corpus, trained every step under torchrun through two injected crashes (two automatic
restarts), the goodput it prints and returns is the one ``steadytrain report`` gives for the
same run (one number: the report's breakdown, ``straggler_wait`` included), the report it
names exists and says the job finished, and the planner's recommendation was computed from
the costs measured in that ledger.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from steadytrain.testing import forkserver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_demo_command_reduced(tmp_path) -> None:
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / "demo")
    cmd = [sys.executable, "-m", "steadytrain.cli", "demo", "--json", "--run-dir", run_dir]
    cmd += ["--corpus-bytes", "400000", "--steps", "40", "--workers", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # stdout holds only the JSON object
    assert out["run_dir"] == run_dir
    assert out["dataset"]["verified"] is True and out["dataset"]["num_tokens"] > 400_000
    assert out["steps"] == 40 and out["restarts"] == 2
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    assert sum(r["type"] == "job_start" for r in records) == 3
    assert 0.0 < out["goodput"] < 1.0
    assert os.path.getsize(out["report"]) > 0
    # One number: `steadytrain report` of the same run says what the demo printed (forked
    # from the fork server: the demo above is the user's fresh command, this a reading of
    # its numbers, without the PNGs the demo's own report drew).
    rep = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "report", run_dir, "--json", "--no-plots",
         "--out", str(tmp_path / "report")],
        timeout=120,
    )  # fmt: skip
    assert rep.returncode == 0, rep.stderr[-3000:]
    report = json.loads(rep.stdout)
    assert out["goodput"] == report["goodput"]
    assert out["breakdown"]["badput_s"] == pytest.approx(report["badput_s"])
    printed = re.search(r"\[demo\] +goodput +([\d.]+) %", proc.stderr)
    assert printed and printed[1] == f"{100 * report['goodput']:.1f}", proc.stderr[-2000:]
    for name, share in report["badput"].items():  # every bucket the report has, as printed
        assert re.search(rf"\[demo\] +{name} +{100 * share:5.1f} %", proc.stderr), name
    assert out["job_state"]["state"] == "finished" == report["job_state"]["state"]
    assert "job finished at step 40 of 40" in proc.stderr
    plan = out["plan"]
    assert plan["measured"]["ckpt_cost_s"] > 0 and plan["measured"]["interruptions_per_day"] > 0
    assert plan["this_run"]["optimal_interval_min"] > 0
    assert "[demo] 4/4" in proc.stderr and "[fault]" in proc.stderr
    # The mid-step crash (after the backward, before the update) comes back in place from
    # the survivor's live model and optimizer, nothing redone: the train loop's loss
    # all-reduce runs before optimizer.step, so the survivor meets the loss there.
    done_before_kill = out["crashes"][0] - 1  # the kill fires inside step `crashes[0]`
    live = [r for r in out["recoveries"] if r["path"] == "in_place" and "live state" in r["why"]]
    assert [(r["from_step"], r["step"]) for r in live] == [(done_before_kill,) * 2], out
