"""``steadytrain plan`` through ``steadytrain.cli.main``, and ``--from-run`` on a real ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadytrain.cli import main
from steadytrain.planning import measure_run, optimal_interval_s


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


# -- --from-run on a ledger written in the HELPERS.md schema ------------------------------


class LedgerRun:
    """A small simulated run with known costs, written record by record to ledger.jsonl.

    Steps take 1.8 s of compute and 0.2 s of data wait; every 10th step a save blocks 0.5 s
    and becomes durable 3.0 s after it started. Failures are followed by ``gap`` seconds of
    detection and queueing, then startup (15 s) and restore (5 s) before the first step.
    """

    STARTUP, RESTORE, BLOCK, DURABLE = 15.0, 5.0, 0.5, 3.0

    def __init__(self, run_dir: Path, t0: float = 1_800_000_000.0, world_size: int = 16):
        self.f = open(run_dir / "ledger.jsonl", "w")
        self.t, self.attempt, self.world = t0, 0, world_size
        self.step, self.last_ckpt = 0, 0
        self.begin = t0

    def write(self, **rec) -> None:
        self.f.write(json.dumps(rec) + "\n")

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
                data_wait_s=0.2, compute_s=1.8, checkpoint_block_s=block, loss=3.0,
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
        self.f.close()


def make_run(run_dir: Path) -> tuple[LedgerRun, float]:
    run = LedgerRun(run_dir)
    run.start(restore=False)
    run.steps(25)  # crash after step 25: checkpoint 20 is durable
    run.crash(gap=40.0)
    run.start(restore=True)
    run.steps(43)
    run.crash(gap=100.0)
    run.start(restore=True)
    run.steps(60)
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
    assert m.interruptions_per_day == pytest.approx(2 / wall_days)


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


def test_from_run_errors_name_the_file(tmp_path, capsys):
    err = plan_error(capsys, "--from-run", str(tmp_path))
    assert "ledger.jsonl" in err
    (tmp_path / "ledger.jsonl").write_text('{"type": "step", "t": 1}\nnot json\n{"type":"x"}\n')
    assert "ledger.jsonl:2" in plan_error(capsys, "--from-run", str(tmp_path))
