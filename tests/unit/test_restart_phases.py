"""The restart ledger's arithmetic (report/restarts.py, run_phases.py), on run directories
written record by record: every phase where it belongs, the phases plus a steady step equal
each restart's wall time, an undivided gap when no rank recorded the failure, an older
ledger's one start-up, and the planner's restart cost from the phases."""

from __future__ import annotations

import json
import os

import pytest

from steadytrain.diagnose.inputs import load
from steadytrain.planning.run_costs import measure_run, phase_means
from steadytrain.report.restarts import attempt_rows, restart_lines, restart_rows
from steadytrain.run_phases import StartupClock


def _write(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _start(t: float, attempt: int, startup: float, restore: float, phases=None) -> dict:
    rec = {"type": "job_start", "t": t, "attempt": attempt, "world_size": 2}
    rec.update(startup_s=startup, restore_s=restore, restored_step=4 * attempt)
    if phases is not None:
        rec["startup_phases"] = phases
    return rec


def _steps(first: int, ts: list[float], step_s: list[float]) -> list[dict]:
    return [
        {"type": "step", "t": t, "step": first + i, "tokens": 8, "step_s": s, "compute_s": s}
        for i, (t, s) in enumerate(zip(ts, step_s, strict=True))
    ]


PHASES_0 = {"imports_s": 3.0, "build_s": 1.0, "group_s": 0.5, "setup_s": 0.5}
PHASES_1 = {"imports_s": 5.0, "build_s": 2.0, "group_s": 0.5, "setup_s": 0.5}


def _run(
    tmp_path,
    *,
    rank0_end: bool = True,
    rank1_end: bool = True,
    phases: bool = True,
    failed_save: bool = False,
):
    """Attempt 0: rank 0 steps until t=105, rank 1 until t=106; rank 0 records an error at
    107, rank 1 a SIGTERM at 108. Attempt 1: born at 110, job_start at 120 (8 s start-up,
    2 s restore), its first step at 123 (3 s after job_start), steady steps of 1 s."""
    run = str(tmp_path / "run")
    ledger = [_start(100.0, 0, 5.0, 0.0, PHASES_0 if phases else None)]
    ledger += _steps(1, [101.0, 102.0, 103.0, 104.0, 105.0], [1.0] * 5)
    if failed_save:  # a save that failed after the last step: no progress (goodput agrees)
        ledger.append({"type": "checkpoint", "t": 106.5, "step": 5, "ok": False})
    if rank0_end:
        ledger.append({"type": "job_end", "t": 107.0, "step": 5, "reason": "error: RuntimeError"})
    ledger.append(_start(120.0, 1, 8.0, 2.0, PHASES_1 if phases else None))
    ledger += _steps(5, [123.0, 124.0, 125.0, 126.0, 127.0], [3.0, 1.0, 1.0, 1.2, 0.8])
    _write(os.path.join(run, "ledger.jsonl"), ledger)
    r1 = [{"type": "rank_start", "t": 100.0, "attempt": 0, "rank": 1, "world_size": 2}]
    r1 += [
        {"type": "rank_step", "step": s, "attempt": 0, "t": 100.0 + s, "step_s": 1.0}
        for s in range(1, 7)
    ]
    if rank1_end:
        r1.append(
            {"type": "rank_end", "t": 108.0, "attempt": 0, "step": 6, "reason": "signal: SIGTERM"}
        )
    r1.append({"type": "rank_start", "t": 120.0, "attempt": 1, "rank": 1, "world_size": 2})
    _write(os.path.join(run, "ranks", "rank-00001.jsonl"), r1)
    return run


def test_each_phase_where_it_belongs_and_they_add_up(tmp_path) -> None:
    records = load(_run(tmp_path))
    (row,) = restart_rows(records)
    assert row["attempt"] == 1 and row["after"] == 0
    assert row["reason"] == "error: RuntimeError"
    want = {
        "detection_s": 1.0,  # rank 1's last step (106) -> rank 0's error (107)
        "teardown_s": 1.0,  # -> rank 1's SIGTERM end (108), the last record
        "relaunch_s": 2.0,  # -> birth: 120 - 8 - 2 = 110
        **PHASES_1,
        "restore_s": 2.0,
        "first_step_excess_s": 2.0,  # 3 s from job_start to the first step, steady 1 s
    }
    assert row["phases"] == pytest.approx(want)
    assert list(row["phases"]) == list(want)  # in the order they happen
    assert row["steady_step_s"] == pytest.approx(1.0)
    assert row["wall_s"] == pytest.approx(123.0 - 106.0)
    assert sum(row["phases"].values()) + row["steady_step_s"] == pytest.approx(row["wall_s"])
    first = attempt_rows(records)[0]
    assert first["phases"] == pytest.approx(
        {**PHASES_0, "restore_s": 0.0, "first_step_excess_s": 0.0}
    )
    lines = restart_lines({"restart_phases": [row], "attempt_phases": attempt_rows(records)})
    assert lines[0] == (
        "attempt 0 start-up: imports 3.00, build 1.00, group 0.50, setup 0.50, restore 0.00, "
        "first step excess 0.00 s"
    )
    assert lines[1].startswith("restart into attempt 1: 17.00 s") and "relaunch 2.00" in lines[1]


def test_a_failed_save_is_not_progress(tmp_path) -> None:
    (row,) = restart_rows(load(_run(tmp_path, failed_save=True)))
    assert row["wall_s"] == pytest.approx(123.0 - 106.0)  # from rank 1's last step, as before
    assert row["phases"]["detection_s"] == pytest.approx(1.0)
    assert sum(row["phases"].values()) + row["steady_step_s"] == pytest.approx(row["wall_s"])


def test_no_rank_recorded_the_failure_the_gap_is_undivided(tmp_path) -> None:
    (row,) = restart_rows(load(_run(tmp_path, rank0_end=False, rank1_end=False)))
    phases = row["phases"]
    assert "detection_s" not in phases and "teardown_s" not in phases
    assert phases["undivided_s"] == pytest.approx(110.0 - 106.0)
    assert sum(phases.values()) + row["steady_step_s"] == pytest.approx(row["wall_s"])


def test_an_older_ledger_has_one_startup(tmp_path) -> None:
    (row,) = restart_rows(load(_run(tmp_path, phases=False)))
    assert row["phases"]["startup_s"] == pytest.approx(8.0)
    assert "imports_s" not in row["phases"]
    assert sum(row["phases"].values()) + row["steady_step_s"] == pytest.approx(row["wall_s"])
    assert phase_means([row]) is None  # the planner keeps its older R


def test_the_planner_takes_its_restart_cost_from_the_phases(tmp_path) -> None:
    run = _run(tmp_path)
    (row,) = restart_rows(load(run))
    m = measure_run(run)
    assert m.restart_phases_s == pytest.approx(row["phases"])
    assert m.restart_cost_s == pytest.approx(sum(row["phases"].values()))
    assert m.restart_exposed_s == pytest.approx(2.0 + 2.0)  # restore + first step's excess


def test_startup_clock_phases_add_up_and_never_go_negative() -> None:
    clock = StartupClock(born=100.0, imported=103.0)
    clock.entered = 104.5
    clock.group_s = 0.25
    assert clock.phases(5.0) == pytest.approx(
        {"imports_s": 3.0, "build_s": 1.5, "group_s": 0.25, "setup_s": 0.25}
    )
    # A start-up shorter than what the marks claim (a clock that stepped): clamped into it.
    got = clock.phases(2.0)
    assert got == pytest.approx({"imports_s": 2.0, "build_s": 0.0, "group_s": 0.0, "setup_s": 0.0})
    assert sum(got.values()) == pytest.approx(2.0)
