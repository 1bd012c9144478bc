"""Evaluation is its own bucket (issue 42, 2), through ``steadytrain.Run`` in one process.

The time inside ``run.phase("eval")`` is the next step record's ``eval_s``, never its data
wait, compute or checkpoint block; ``Run.clock`` (the trainer callbacks' clock) stops inside
it. A start that failed before its restore point was known (``TrainerSaves(None)``, the
Lightning callback's failed ``setup``) keeps the ledger's position: nothing is charged as
redone until an attempt really restores. Sleeps are lower bounds only: nothing here
asserts how fast the machine is.
"""

from __future__ import annotations

import os
import time

import pytest

from steadytrain import Run
from steadytrain.integrations.hooks import TrainerSaves, record_failed_start
from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import read_ledger
from steadytrain.report.build import build_report

EVAL_S = 0.3


def _ledger(run_dir) -> list[dict]:
    return read_ledger(os.path.join(run_dir, "ledger.jsonl"))


def _steps(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in _ledger(run_dir) if r["type"] == "step"}


def test_run_books_an_evaluation_as_eval_not_data_wait_compute_or_save(tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    with Run(run_dir, {}, checkpoint=False) as run:
        for step in range(1, 5):
            with run.data_wait():
                time.sleep(0.01)  # a fetch: the only data wait
            run.step_done(step, tokens=8)
            if step == 2:  # after step 2: an evaluation, nested phases counted once
                with run.phase("eval"), run.phase("eval"):
                    time.sleep(EVAL_S)
    steps = _steps(run_dir)
    ev = steps[3]
    assert ev["eval_s"] >= EVAL_S, ev
    assert ev["eval_s"] <= ev["step_s"]
    # Whatever the machine's speed: the step's own buckets hold none of the evaluation.
    assert ev["data_wait_s"] + ev["compute_s"] + ev["checkpoint_block_s"] <= (
        ev["step_s"] - ev["eval_s"] + 1e-6
    ), ev
    assert ev["data_wait_s"] < EVAL_S
    assert all(steps[s]["eval_s"] == 0.0 for s in (1, 2, 4)), steps
    b = compute_goodput(_ledger(run_dir))
    assert b.badput_s["eval"] == pytest.approx(ev["eval_s"])
    assert b.badput_s["data_wait"] < EVAL_S and b.goodput_s < b.total_s - EVAL_S
    # The report's one breakdown (text, JSON and HTML print it) has the bucket.
    rep = build_report(run_dir, str(tmp_path / "out"))
    assert rep["badput_s"]["eval"] == pytest.approx(ev["eval_s"])
    assert ">eval</td>" in open(rep["html"], encoding="utf-8").read()
    ranks = rep["ranks"][0]  # rank 0's own file carries it too
    assert ranks["eval_s"] == pytest.approx(ev["eval_s"])
    busy = ranks["step_s"] - ranks["eval_s"]
    assert ranks["data_wait_share"] == pytest.approx(ranks["data_wait_s"] / busy)


def test_the_run_clock_stops_inside_an_evaluation(tmp_path) -> None:
    with Run(str(tmp_path / "run"), {}, checkpoint=False) as run:
        wall0, clock0 = time.perf_counter(), run.clock()
        with run.phase("eval"):
            time.sleep(EVAL_S)
        with run.phase("checkpoint"):  # any other phase is ordinary time
            time.sleep(0.05)
        wall, clock = time.perf_counter() - wall0, run.clock() - clock0
        run.step_done(1)
    assert clock <= wall - EVAL_S + 1e-6 and clock >= 0.05
    rec = _steps(str(tmp_path / "run"))[1]
    assert rec["eval_s"] >= EVAL_S and rec["compute_s"] <= rec["step_s"] - rec["eval_s"] + 1e-6


def test_an_unknown_restore_point_keeps_the_ledgers_position(tmp_path) -> None:
    """Attempt 0 records steps 1-6; attempt 1 fails before its trainer restored (restore
    point unknown): it charges nothing as redone and has no restore row; attempt 2 restores
    step 4 and is charged steps 5-6 once."""
    run_dir = str(tmp_path / "run")
    with Run(run_dir, {}, checkpoint=False) as run:
        for step in range(1, 7):
            run.step_done(step, tokens=8)
    with pytest.raises(ValueError), Run(run_dir, {}, checkpoint=TrainerSaves(None)) as run:
        assert run.start_step == 6
        raise ValueError("failed in setup")
    after = compute_goodput(_ledger(run_dir))
    assert after.steps_lost == 0 and after.attempts == 2 and after.steps_kept == 6
    with Run(run_dir, {}, checkpoint=TrainerSaves(4, "ckpt-4")) as run:
        run.step_done(5, tokens=8)
    b = compute_goodput(_ledger(run_dir))
    assert b.steps_lost == 2 and b.steps_kept == 5
    starts = [r for r in _ledger(run_dir) if r["type"] == "job_start"]
    assert [s["restored_step"] for s in starts] == [0, 6, 4]
    restores = [r for r in _ledger(run_dir) if r["type"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restores] == [(4, "trainer")]


def test_a_failed_start_is_recorded_without_a_run(tmp_path) -> None:
    """What the Lightning callback calls when ``setup`` or the sanity check raised: rank 0
    alone writes the attempt and its crash (no collective: the other ranks may be anywhere),
    at the ledger's position; other ranks write nothing."""
    run_dir = str(tmp_path / "run")
    with Run(run_dir, {}, checkpoint=False) as run:
        for step in range(1, 4):
            run.step_done(step, tokens=8)
    record_failed_start(run_dir, 1, 2, ValueError("nope"), {})
    assert len([r for r in _ledger(run_dir) if r["type"] == "job_start"]) == 1
    record_failed_start(run_dir, 0, 2, ValueError("injected failure in setup"), {})
    recs = _ledger(run_dir)
    start, end = [r for r in recs if r["type"] == "job_start"][-1], recs[-1]
    assert (start["attempt"], start["restored_step"], start["world_size"]) == (1, 3, 2)
    assert start["startup_s"] > 0 and start["run_nonce"] == recs[0]["run_nonce"]
    assert (
        end["type"] == "job_end" and end["reason"] == "error: ValueError: injected failure in setup"
    )
    rep = build_report(run_dir, str(tmp_path / "out"))
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(1, end["reason"])]
    assert rep["steps_lost"] == 0


def test_an_evaluation_after_the_last_step_is_in_the_job_end(tmp_path) -> None:
    """A final evaluation (the HF Trainer's at the last epoch's end) has no step record
    after it to carry it: the ``job_end`` does, and the ``eval`` bucket counts it."""
    run_dir = str(tmp_path / "run")
    with Run(run_dir, {}, checkpoint=False) as run:
        run.step_done(1)
        with run.phase("eval"):
            time.sleep(EVAL_S)
    end = _ledger(run_dir)[-1]
    assert end["type"] == "job_end" and end["eval_s"] >= EVAL_S
    assert compute_goodput(_ledger(run_dir)).badput_s["eval"] == pytest.approx(end["eval_s"])
