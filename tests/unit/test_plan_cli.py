"""``steadytrain plan`` through ``steadytrain.cli.main``, and ``--from-run`` on a real ledger
(written by ``monitor.ledger.Ledger``, the meter's own writer), planned by the CLI and by the
demo through the one ``plan_from_run``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadytrain.cli import main
from steadytrain.demo import demo_plan
from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import Ledger, read_ledger
from steadytrain.planning import goodput_first_order, measure_run, optimal_interval_s
from steadytrain.report.build import build_report


def plan_json(capsys, *argv: str) -> dict:
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def plan_error(capsys, *argv: str) -> str:
    rc = main(["plan", *argv])
    assert rc == 2
    return capsys.readouterr().err


# -- reference points through the CLI -----------------------------------------------------


@pytest.mark.parametrize("gpus,expected", [(256, 0.19), (1024, 0.57)])
def test_p_failure_reference_points(capsys, gpus, expected):
    r = plan_json(capsys, "--gpus", str(gpus), "--days", "30", "--afr", "0.01", "--sim-runs", "0")
    assert r["p_failure"] == pytest.approx(expected, abs=0.01)
    assert r["interruptions_per_day"] == pytest.approx(gpus * 0.01 / 365)
    assert r["expected_interruptions"] == pytest.approx(gpus * 0.01 * 30 / 365)
    assert r["mtbf_hours"] == pytest.approx(8760 / (gpus * 0.01))
    assert "simulation" not in r


@pytest.mark.parametrize("minutes,expected", [(120, 0.64), (30, 0.91)])
def test_llama3_goodput_reference_points(capsys, minutes, expected):
    r = plan_json(
        capsys, "--interruptions-per-day", "8.6", "--interval", str(minutes),
        "--ckpt-cost", "0", "--restart-cost", "0", "--sim-runs", "300",
    )  # fmt: skip
    assert r["goodput"] == pytest.approx(expected, abs=0.01)
    assert r["interval_min"] == minutes and r["interval_source"] == "given"
    sim = r["simulation"]
    assert sim["exact_agrees"] and sim["closed_form_exact"] == r["goodput_exact"]
    assert sim["mean"] >= r["goodput"]  # first order is the conservative bound


def test_free_saves_say_so(capsys):
    r = plan_json(
        capsys, "--interruptions-per-day", "8.6", "--ckpt-cost", "0", "--restart-cost", "0"
    )
    assert r["optimal_interval_min"] == 0.0
    assert r["goodput"] == pytest.approx(1.0) and "simulation" not in r
    assert any("saves cost nothing" in n for n in r["notes"])


def test_optimal_interval_and_table(capsys):
    r = plan_json(
        capsys, "--mtbf-hours", "10", "--ckpt-cost", "60", "--restart-cost", "600",
        "--days", "7", "--sim-runs", "200",
    )  # fmt: skip
    from steadytrain.planning import daly_interval_s, optimal_interval_s, young_interval_s

    m = 10 * 3600
    assert r["optimal_interval_min"] == pytest.approx(optimal_interval_s(60, m, 600) / 60)
    assert r["young_interval_min"] == pytest.approx(young_interval_s(60, m) / 60)
    assert r["daly_interval_min"] == pytest.approx(daly_interval_s(60, m) / 60)
    assert r["interval_source"] == "optimal"
    assert r["mode"] == "sync"
    # sync vs async: async (assumed C/10) allows a shorter interval and more goodput
    sync, asyn = r["modes"]["sync"], r["modes"]["async"]
    assert asyn["assumed"] and asyn["ckpt_cost_s"] == pytest.approx(6.0)
    assert asyn["optimal_interval_min"] < sync["optimal_interval_min"]
    assert asyn["goodput_at_optimal"] > sync["goodput_at_optimal"]
    # the table covers both modes at every interval, and the optimum beats every row
    rows = [x for x in r["table"] if x["mode"] == "sync"]
    assert len(rows) == len([x for x in r["table"] if x["mode"] == "async"]) >= 7
    assert max(x["goodput_exact"] for x in rows) <= sync["goodput_exact_at_optimal"] + 1e-12


def test_conflicting_rate_flags_name_both(capsys):
    err = plan_error(capsys, "--afr", "0.01", "--mtbf-hours", "100")
    assert "--afr" in err and "--mtbf-hours" in err
    err = plan_error(capsys, "--interruptions-per-day", "3", "--mtbf-hours", "100")
    assert "--interruptions-per-day" in err and "--mtbf-hours" in err
    err = plan_error(capsys, "--gpus", "64", "--mtbf-hours", "100")
    assert "--gpus" in err and "--afr" in err


def test_bad_values_are_clear_errors(capsys):
    assert "--interval" in plan_error(capsys, "--interval", "0")
    assert "afr" in plan_error(capsys, "--gpus", "8", "--afr", "-0.5")
    assert "data stall" in plan_error(capsys, "--data-stall", "1.5")


def test_defaults_are_stated(capsys):
    r = plan_json(capsys, "--sim-runs", "100")
    assert r["sources"] == {
        "ckpt_cost_s": "default",
        "restart_cost_s": "default",
        "data_stall_frac": "default",
    }
    assert any("--gpus 1024" in n for n in r["notes"])
    assert r["interruptions_per_day"] == pytest.approx(1024 * (466 / 54) / 16384)


def test_human_output(capsys):
    rc = main(["plan", "--gpus", "512", "--afr", "0.05", "--sim-runs", "100"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("P(>=1 failure in 30 days)", "optimal interval", "Young / Daly / exact", "async"):
        assert text in out


# -- --from-run on a ledger written by the meter's writer (monitor.ledger.Ledger) ----------


class LedgerRun:
    """A small simulated run with known costs, written record by record to ledger.jsonl.

    Steps take 2.0 s: ``data_wait`` s waiting for data (default 0.2) and the rest compute;
    every 10th step a save blocks 0.5 s more and becomes durable 3.0 s after it started.
    Failures are followed by ``gap`` seconds of detection and queueing, then startup (15 s)
    and restore (5 s) before the first step. The clock is simulated (the meter would stamp
    wall time), the writer is the real one.
    """

    STARTUP, RESTORE, BLOCK, DURABLE = 15.0, 5.0, 0.5, 3.0

    def __init__(
        self,
        run_dir: Path,
        t0: float = 1_800_000_000.0,
        world_size: int = 16,
        data_wait: float = 0.2,
    ):
        self.ledger = Ledger(run_dir)
        self.t, self.attempt, self.world = t0, 0, world_size
        self.step, self.last_ckpt = 0, 0
        self.begin = t0
        self.data_wait = data_wait

    def write(self, **rec) -> None:
        self.ledger.write([rec])

    def start(self, restore: bool) -> None:
        restore_s = self.RESTORE if restore else 0.0
        self.t += self.STARTUP + restore_s  # job_start is written once they are done
        self.write(
            type="job_start", t=self.t, attempt=self.attempt, world_size=self.world,
            restored_step=self.last_ckpt, startup_s=self.STARTUP, restore_s=restore_s,
            config={},
        )  # fmt: skip
        if restore:
            self.write(type="restore", t=self.t, step=self.last_ckpt, restore_s=restore_s,
                       path=f"ckpt/step-{self.last_ckpt}", skipped=[])  # fmt: skip
        self.step = self.last_ckpt

    def steps(self, until: int) -> None:
        pending = None
        while self.step < until:
            self.step += 1
            block = self.BLOCK if self.step % 10 == 0 else 0.0
            self.t += 2.0 + block
            self.write(
                type="step", t=self.t, step=self.step, tokens=4096, step_s=2.0 + block,
                data_wait_s=self.data_wait, compute_s=2.0 - self.data_wait,
                checkpoint_block_s=block, loss=3.0,
            )  # fmt: skip
            if pending and self.t >= pending[0]:
                self._durable(*pending)
                pending = None
            if block:
                pending = (self.t - block + self.DURABLE, self.step)

    def _durable(self, t: float, step: int) -> None:
        self.write(type="checkpoint", t=t, step=step, block_s=self.BLOCK,
                   durable_s=self.DURABLE, ok=True, path=f"ckpt/step-{step}", error=None)  # fmt: skip
        self.last_ckpt = step

    def crash(self, gap: float) -> None:
        self.t += gap
        self.attempt += 1

    def finish(self) -> None:
        self.write(type="job_end", t=self.t, step=self.step, reason="finished")
        self.ledger.close()


def make_run(run_dir: Path, data_wait: float = 0.2) -> tuple[LedgerRun, float]:
    run = LedgerRun(run_dir, data_wait=data_wait)
    run.start(restore=False)
    # Failures come a few minutes of up-time apart, longer than a restart (90 s): the
    # regime the first-order model is meant for.
    run.steps(125)  # crash after step 125: checkpoint 120 is durable
    run.crash(gap=40.0)
    run.start(restore=True)
    run.steps(243)
    run.crash(gap=100.0)
    run.start(restore=True)
    run.steps(260)
    run.finish()
    return run, run.begin


def test_from_run_measures_costs(tmp_path):
    run, begin = make_run(tmp_path)
    m = measure_run(tmp_path)
    assert m.attempts == 3 and m.interruptions == 2 and m.world_size == 16
    assert m.ckpt_cost_s == pytest.approx(LedgerRun.BLOCK)
    assert m.durable_s == pytest.approx(LedgerRun.DURABLE)
    # R = gap + startup + restore per restart: (40 + 20 + 100 + 20) / 2
    assert m.restart_cost_s == pytest.approx(90.0)
    assert m.restart_gap_s == pytest.approx(70.0)
    assert m.data_stall_frac == pytest.approx(0.1)
    wall_days = (run.t - begin) / 86400
    assert m.wall_days == pytest.approx(wall_days)
    # The rate is over the time attempts were up (restore start to failure): the wall time
    # less the first start-up and, per restart, its gap and start-up (dead time).
    up_s = (run.t - begin) - LedgerRun.STARTUP - (40 + 15) - (100 + 15)
    assert m.exposure_days * 86400 == pytest.approx(up_s) and up_s == pytest.approx(559.0)
    assert m.interruptions_per_day == pytest.approx(2 / (up_s / 86400))
    assert m.restart_exposed_s == pytest.approx(LedgerRun.RESTORE)  # U: restore, no warm-up
    # redone work: steps 121-125 and 241-243 (8 steps of 1.8 s compute), 2 interruptions
    assert m.steps_lost == 8
    assert m.lost_per_interruption_s == pytest.approx(8 * 1.8 / 2)


def test_measured_costs_are_the_reports_buckets(tmp_path):
    # The planner reads the ledger through monitor: its goodput and buckets are the ones
    # `steadytrain report` computes, and each model input adds up to its bucket.
    # That is the report's own breakdown: rank 0's ledger with what the report charges
    # (the straggler buckets: none waited here).
    make_run(tmp_path)
    m = measure_run(tmp_path)
    b = compute_goodput(read_ledger(tmp_path / "ledger.jsonl"))
    s = build_report(tmp_path, tmp_path / "report")
    assert m.goodput == s["goodput"] == b.goodput and m.total_s == s["total_s"] == b.total_s
    assert m.badput_s == s["badput_s"]
    assert m.badput_s == {**b.badput_s, "straggler_wait": 0.0, "straggler_compute": 0.0}
    assert m.wall_days == pytest.approx(b.total_s / 86400)
    bad = b.badput_s
    first_start = LedgerRun.STARTUP  # the first attempt restored nothing
    restarts = bad["restart_gap"] + bad["startup"] + bad["restore"] - first_start
    assert m.restart_cost_s * m.interruptions == pytest.approx(restarts)
    assert m.restart_gap_s * m.interruptions == pytest.approx(bad["restart_gap"])
    busy = bad["data_wait"] + b.goodput_s + bad["lost_to_failures"]
    assert m.data_stall_frac == pytest.approx(bad["data_wait"] / busy)
    assert m.lost_per_interruption_s * m.interruptions == pytest.approx(bad["lost_to_failures"])
    # the plan's terms fold the buckets without losing any time
    assert m.badput["restart"] * b.total_s == pytest.approx(
        bad["startup"] + bad["restore"] + bad["restart_gap"]
    )
    assert m.goodput + sum(m.badput.values()) == pytest.approx(1.0)


def test_plan_from_run(tmp_path, capsys):
    make_run(tmp_path)
    m = measure_run(tmp_path)
    r = plan_json(capsys, "--from-run", str(tmp_path), "--days", "1", "--sim-runs", "200")
    assert r["mode"] == "async"
    assert r["ckpt_cost_s"] == pytest.approx(0.5) and r["durable_s"] == pytest.approx(3.0)
    assert r["restart_cost_s"] == pytest.approx(90.0)
    assert r["data_stall_frac"] == pytest.approx(0.1)
    assert r["sources"]["ckpt_cost_s"] == "measured"
    assert r["interruptions_per_day"] == pytest.approx(m.interruptions_per_day)
    assert "observed" in r["failure_model"]
    assert r["measured"]["restart_cost_s"] == pytest.approx(90.0)
    assert r["modes"]["sync"]["ckpt_cost_s"] == pytest.approx(3.0)  # sync waits for durability
    best = optimal_interval_s(0.5, r["mtbf_hours"] * 3600, 90.0, 3.0)
    assert r["optimal_interval_min"] == pytest.approx(best / 60)
    # a given rate and cost win over the measured ones
    r = plan_json(capsys, "--from-run", str(tmp_path), "--afr", "0.02", "--gpus", "8",
                  "--ckpt-cost", "2", "--sim-runs", "0")  # fmt: skip
    assert r["interruptions_per_day"] == pytest.approx(8 * 0.02 / 365)
    assert r["sources"]["ckpt_cost_s"] == "given" and r["ckpt_cost_s"] == 2.0
    assert r["sources"]["restart_cost_s"] == "measured"


def test_from_run_without_failures_falls_back_with_a_note(tmp_path, capsys):
    run = LedgerRun(tmp_path, world_size=64)
    run.start(restore=False)
    run.steps(30)
    run.finish()
    r = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0")
    assert any("no interruption" in n for n in r["notes"])
    assert any("--gpus 64" in n for n in r["notes"])  # the run's world size
    assert r["restart_cost_s"] == pytest.approx(15.0)  # no restart seen: startup + restore


def test_from_run_errors_name_the_file(tmp_path, capsys, caplog):
    err = plan_error(capsys, "--from-run", str(tmp_path))
    assert "ledger.jsonl" in err
    # Read through monitor's reader like the report: a line that is not JSON is skipped
    # with a warning naming it, and a file without job_start is refused, named.
    (tmp_path / "ledger.jsonl").write_text('{"type": "step", "t": 1}\nnot json\n{"type":"x"}\n')
    err = plan_error(capsys, "--from-run", str(tmp_path))
    assert "ledger.jsonl has no job_start" in err and "--from-run" in err
    assert any("ledger.jsonl:2" in r.getMessage() for r in caplog.records)


def test_from_run_skips_a_torn_line_like_the_report(tmp_path, capsys, caplog):
    make_run(tmp_path)
    before = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0")
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"type": "step", "t": 1')  # a crash mid-write
    after = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0")
    assert after == before
    assert any("torn" in r.getMessage() for r in caplog.records)


# -- one plan-from-run function: the CLI and the demo ----------------------------------------

DEMO_KEYS = (
    "interruptions_per_day", "optimal_interval_min", "goodput_at_optimal", "goodput",
    "ckpt_cost_s", "durable_s", "restart_cost_s", "data_stall_frac", "badput",
)  # fmt: skip


def test_cli_and_demo_plan_the_same_run_alike(tmp_path, capsys):
    make_run(tmp_path, data_wait=0.4)
    demo = demo_plan(str(tmp_path))
    # the demo's "this run" is `plan --from-run RUN_DIR --days 1`, its cluster projection
    # is the same with the Llama 3 rate
    here = plan_json(capsys, "--from-run", str(tmp_path), "--days", "1", "--sim-runs", "200")
    cluster = plan_json(
        capsys, "--from-run", str(tmp_path), "--interruptions-per-day", "8.6", "--sim-runs", "200"
    )
    assert set(demo["this_run"]) == set(DEMO_KEYS)
    for key in DEMO_KEYS:
        assert demo["this_run"][key] == here[key], key
        assert demo["cluster"][key] == cluster[key], key
    assert demo["measured"] == here["measured"]
    # the demo counts the run's data stall (it used to plan as if there was none)
    assert demo["this_run"]["data_stall_frac"] == pytest.approx(0.2)
    assert here["sources"]["data_stall_frac"] == "measured"
    assert demo["this_run"]["badput"]["data_wait"] > 0


def test_data_stalls_change_the_plan(tmp_path, capsys):
    stalled, clean = tmp_path / "stalled", tmp_path / "clean"
    stalled.mkdir()
    clean.mkdir()
    make_run(stalled, data_wait=0.5)  # same clock, same failures: only the wait differs
    make_run(clean, data_wait=0.0)
    argv = ("--days", "1", "--sim-runs", "0")
    s = plan_json(capsys, "--from-run", str(stalled), *argv)
    c = plan_json(capsys, "--from-run", str(clean), *argv)
    assert s["data_stall_frac"] == pytest.approx(0.25) and c["data_stall_frac"] == 0.0
    # the interval does not move (a stall scales goodput, it is not a failure cost) ...
    assert s["optimal_interval_min"] == pytest.approx(c["optimal_interval_min"])
    # ... but the goodput the plan promises drops by the waiting share
    assert s["goodput"] == pytest.approx(0.75 * c["goodput"])
    mtbf_s = s["mtbf_hours"] * 3600
    tau = s["interval_min"] * 60
    assert s["goodput"] == pytest.approx(
        goodput_first_order(tau, 0.5, mtbf_s, 90.0, 3.0, stall_frac=0.25)
    )
    assert s["badput"]["data_wait"] > 0.0 == c["badput"]["data_wait"]
    # the run itself measured the same: its goodput is lower by the wait
    assert s["measured"]["goodput"] < c["measured"]["goodput"]
    assert s["measured"]["badput_s"]["data_wait"] > 0.0 == c["measured"]["badput_s"]["data_wait"]
    # and the demo sees it the same way
    ds, dc = demo_plan(str(stalled)), demo_plan(str(clean))
    assert ds["this_run"]["goodput"] == s["goodput"] < dc["this_run"]["goodput"] == c["goodput"]


def test_cli_help_defaults_are_the_planners():
    from steadytrain.commands import plan as command
    from steadytrain.planning import from_run

    assert command.DEFAULT_CKPT_COST_S == from_run.DEFAULT_CKPT_COST_S
    assert command.DEFAULT_RESTART_COST_S == from_run.DEFAULT_RESTART_COST_S


def test_human_output_from_run_shows_measured_and_model_badput(tmp_path, capsys):
    make_run(tmp_path)
    assert main(["plan", "--from-run", str(tmp_path), "--sim-runs", "0"]) == 0
    out = capsys.readouterr().out
    assert "this run (measured)" in out and "badput at that interval (model)" in out
    assert "data_wait" in out and "lost_to_failures" in out
