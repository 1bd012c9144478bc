"""One set of numbers, nothing unexplained (issue 42, 3).

- an attempt's set-up between ``job_start`` and its first step (the meter's sinks opening,
  the watchdog, the loop's preparation) is start-up, not ``other``;
- a commit the ledger missed (an attempt killed right after COMMIT) is proven by its
  restores: the steps up to it stay kept however often it is restored, the report counts
  it and dates the recovery point by its COMMIT, and the next start writes it back;
- the report's first line, in text, JSON and HTML, is the job's state, and its restart
  loop is one incident in the culprit's own words.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from steadytrain import Run
from steadytrain.cli import main
from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter

sys.path.insert(0, os.path.dirname(__file__))

from test_diagnose_failures import LOOP_TOTAL, restart_loop_run  # noqa: E402
from test_monitor_goodput import end, start, step  # noqa: E402


def test_the_first_steps_set_up_is_startup_not_other() -> None:
    """Attempt 0's first step record ends 6 s after job_start but trained 0.5 s: the 5.5 s
    before it are set-up (the demo's rank 0 waited that long for MLflow's store to open);
    every later step is all compute. So ``other`` is 0 and ``startup`` 2 + 5.5."""
    recs = [start(100.0, startup=2.0), step(106.0, 1, step_s=6.0, compute=0.5, dw=0.0)]
    recs += [step(106.0 + 0.5 * i, 1 + i, step_s=0.5, compute=0.5, dw=0.0) for i in range(1, 10)]
    recs += [start(115.0, attempt=1, restored=10, startup=1.0)]  # a second attempt, 3 s set-up
    recs += [step(118.5, 11, step_s=3.5, compute=0.5, dw=0.0), end(118.5, 11)]
    b = compute_goodput(recs)
    assert b.badput_s["startup"] == pytest.approx(2.0 + 5.5 + 1.0 + 3.0)
    assert b.badput_s["other"] == pytest.approx(0.0, abs=1e-9)
    assert b.goodput_s == pytest.approx(11 * 0.5)
    assert b.goodput_s + sum(b.badput_s.values()) == pytest.approx(b.total_s)


def _loop_ledger(restore_records: bool = True, tier: str = "durable") -> list[dict]:
    """Attempt 0 trains steps 1..5; step 4 committed at t=4.05 but its record was lost;
    attempts 1..3 each restore step 4, redo step 5 and die."""
    recs = [start(0.0)] + [step(float(s), s) for s in range(1, 6)]
    t = 5.0
    for a in (1, 2, 3):
        t += 10.0
        recs.append(start(t, attempt=a, restored=4))
        if restore_records:
            recs.append({"type": "restore", "t": t, "step": 4, "tier": tier, "commit_t": 4.05})
        recs.append(step(t + 1.0, 5))
        t += 1.0
    return recs


def test_a_step_restored_three_times_keeps_the_steps_up_to_it() -> None:
    """Before: the second restore of step 4 fell back to step 0 ("1 steps kept, 7 redone")."""
    for records in (True, False):  # with restore records, and job_start's restored_step alone
        b = compute_goodput(_loop_ledger(restore_records=records))
        assert (b.steps_kept, b.steps_lost, b.last_step) == (5, 3, 5)
        assert b.badput_s["lost_to_failures"] == pytest.approx(3 * 0.8)


def test_a_durable_restore_proves_the_commit_the_ledger_lost() -> None:
    b = compute_goodput(_loop_ledger())
    assert (b.checkpoints, b.checkpoints_reconciled) == (1, 1)
    assert b.recovery_point_age_s == pytest.approx(38.0 - 4.05)  # end - the COMMIT's time
    # a memory-tier restore proves no durable commit
    b = compute_goodput(_loop_ledger(tier="local-memory"))
    assert (b.checkpoints, b.checkpoints_reconciled) == (0, 0)
    assert b.steps_kept == 5


def test_a_commit_the_ledger_lost_is_written_back_at_the_next_start(tmp_path: Path) -> None:
    """A real Run commits step 4; its ``checkpoint`` record is then taken out of the ledger
    (the attempt died before the record left the meter's queue). The next Run restores step
    4 and writes the commit back once, dated by the checkpoint's COMMIT; a third start
    does not write it again."""
    run_dir, model = tmp_path / "run", torch.nn.Linear(2, 2)
    checkpoint = {"every_steps": 4, "async_mode": "sync"}
    with Run(run_dir, {"model": model}, checkpoint=checkpoint, total_steps=20) as run:
        for s in range(1, 6):
            run.step_done(s)  # step 4 commits; the clean exit commits step 5
    ledger = run_dir / "ledger.jsonl"
    recs = read_ledger(ledger)
    kept = [r for r in recs if r["type"] not in ("checkpoint", "job_end")]
    ledger.write_text("".join(json.dumps(r) + "\n" for r in kept))
    commit = json.loads((run_dir / "checkpoints" / "step-00000005" / "COMMIT").read_text())
    for _ in range(2):
        with Run(run_dir, {"model": model}, checkpoint=checkpoint, total_steps=20) as run:
            assert run.start_step == 5
    recs = read_ledger(ledger)
    written = [r for r in recs if r["type"] == "checkpoint" and r.get("recovered")]
    assert len(written) == 1, written
    [rec] = written
    assert rec["step"] == 5 and rec["ok"] is True
    assert rec["t"] == pytest.approx(commit["wall_time"])
    starts = [i for i, r in enumerate(recs) if r["type"] == "job_start"]
    assert starts[0] < recs.index(rec) < starts[1]  # it belongs to the attempt that committed
    assert recs[starts[0]]["total_steps"] == 20
    b = compute_goodput(recs)
    assert b.checkpoints == 1 and b.checkpoints_reconciled == 0  # a record now, not a guess


def test_the_meter_writes_no_commit_for_a_memory_restore_or_a_known_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with GoodputMeter(run_dir) as m:
        m.job_start()
        for s in (1, 2, 3):
            m.step(s, tokens=1, data_wait_s=0.0, compute_s=0.01)
        m.event({"type": "checkpoint", "step": 2, "ok": True, "block_s": 0.0, "path": "p"})
    for restored in ({"type": "restore", "step": 3, "tier": "local-memory"},
                     {"type": "restore", "step": 2, "tier": "durable", "commit_t": 1.0}):  # fmt: skip
        with GoodputMeter(run_dir) as m:
            m.job_start(restored_step=restored["step"], restored_from=restored)
    assert not [r for r in read_ledger(run_dir / "ledger.jsonl") if r.get("recovered")
                and r["type"] == "checkpoint"]  # fmt: skip


def _report(tmp_path: Path, capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["report", *args]) == 0
    return capsys.readouterr().out


def test_the_restart_loop_report_agrees_with_itself_and_says_the_job_stopped(
    tmp_path: Path, capsys
) -> None:
    """The issue's run: step 4 committed (no ledger record) and was restored three times,
    then torchrun gave up at step 5 of 20. Before: "0 checkpoints committed", "1 steps
    kept, 7 redone", a recovery point dated from the job's start, "4 attempt(s)" and
    "stop the job"."""
    run = restart_loop_run(tmp_path / "loop").write()
    s = json.loads(_report(tmp_path, capsys, str(run), "--out", str(tmp_path / "r"), "--json"))
    assert s["job_state"]["state"] == "stopped" and s["job_state"]["cause"] == "failures"
    assert (s["job_state"]["step"], s["job_state"]["total_steps"]) == (5, LOOP_TOTAL)
    assert (s["checkpoints"], s["checkpoints_reconciled"]) == (1, 1)
    assert (s["steps_kept"], s["steps_lost"]) == (5, 3)
    assert [r["steps_lost"] for r in s["restores"]] == [1, 1, 1]  # the Restores table
    assert sum(r["steps_lost"] for r in s["restores"]) == s["steps_lost"]
    recs = read_ledger(run / "ledger.jsonl")
    commit_t = next(r["commit_t"] for r in recs if r["type"] == "restore")
    assert s["recovery_point_age_s"] == pytest.approx(max(r["t"] for r in recs) - commit_t)
    [loop] = s["incidents"]
    assert loop["kind"] == "restart-loop" and "is stopped" in loop["advice"]

    text = _report(tmp_path, capsys, str(run), "--out", str(tmp_path / "r"))
    first = text.splitlines()[0]
    assert first.startswith(f"job stopped by failures at step 5 of {LOOP_TOTAL}"), text
    assert "5 steps kept, 3 redone, 1 checkpoint committed (1 known from a restore" in text
    page = Path(s["html"]).read_text()
    body = page.split("<body>", 1)[1]
    assert re.match(r"\s*<p class=\"job-state poor\"><b>job stopped by failures at step 5 of 20",
                    body), body[:300]  # fmt: skip
    assert "1 checkpoint committed" in page and "0 checkpoints committed" not in page


def test_the_planner_averages_measured_saves_only(tmp_path: Path) -> None:
    """A commit written back at the next start has no block or write time: averaged in
    as 0 it would halve the planner's checkpoint cost here."""
    from steadytrain.planning import measure_run

    recs = [start(0.0)] + [step(float(s), s) for s in range(1, 5)]
    recs.insert(3, {"type": "checkpoint", "t": 2.0, "step": 2, "ok": True, "block_s": 0.2,
                    "durable_s": 0.5, "path": "p"})  # fmt: skip
    recs += [{"type": "checkpoint", "t": 4.0, "step": 4, "ok": True, "recovered": True,
              "path": "p"}, start(10.0, attempt=1, restored=4), step(11.0, 5)]  # fmt: skip
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = measure_run(tmp_path)
    assert m.ckpt_cost_s == pytest.approx(0.2) and m.durable_s == pytest.approx(0.5)
