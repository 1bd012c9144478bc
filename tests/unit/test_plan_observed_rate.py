"""``plan --from-run`` against measurement (issue 13, item 4): the run's own failure rate
with its exact Poisson interval, and the first start-up charged to the run."""

from __future__ import annotations

import math
import os
import sys

import pytest

from steadytrain.errors import ConfigError
from steadytrain.planning.failures import rate_interval
from steadytrain.planning.interval import goodput_exact

sys.path.insert(0, os.path.dirname(__file__))

from test_plan_cli import LedgerRun, make_run, plan_json  # noqa: E402


def test_rate_interval_is_the_exact_poisson_interval() -> None:
    # Garwood's table: 0 events -> [0, 3.689], 1 -> [0.0253, 5.572], 10 -> [4.795, 18.39].
    assert rate_interval(0, 1.0) == (0.0, pytest.approx(3.6889, abs=1e-4))
    assert rate_interval(1, 1.0) == (
        pytest.approx(0.02532, abs=1e-5),
        pytest.approx(5.5716, abs=1e-4),
    )
    assert rate_interval(10, 2.0) == (
        pytest.approx(4.7954 / 2, abs=1e-4),
        pytest.approx(18.390 / 2, abs=1e-3),
    )
    lo, hi = rate_interval(3, 1.0, confidence=0.5)
    assert rate_interval(3, 1.0)[0] < lo < 3 < hi < rate_interval(3, 1.0)[1]
    with pytest.raises(ConfigError, match="positive exposure"):
        rate_interval(2, 0.0)


def test_from_run_plans_with_the_observed_rate_and_its_interval(tmp_path, capsys) -> None:
    make_run(tmp_path)  # 2 interruptions
    p = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0", "--interval", "1")
    m = p["measured"]
    assert p["failure_model"].startswith("observed")
    assert p["interruptions_per_day"] == pytest.approx(m["interruptions_per_day"])
    ci = p["failure_rate_ci"]
    lo, hi = ci["interruptions_per_day"]
    wall = m["exposure_days"]  # the rate is over the time the attempts were up
    assert (lo, hi) == (
        pytest.approx(0.2422 / wall, rel=1e-3),
        pytest.approx(7.2247 / wall, rel=1e-3),
    )
    assert lo < p["interruptions_per_day"] < hi
    # The goodput at either end of the rate, at the same interval, brackets the estimate.
    g_lo, g_hi = ci["goodput_exact"]
    assert g_lo < p["goodput_exact"] < g_hi
    mtbf_hi = 86400.0 / hi
    assert g_lo == pytest.approx(
        goodput_exact(
            60.0,
            p["ckpt_cost_s"],
            mtbf_hi,
            restart_s=p["restart_cost_s"],
            restart_exposed_s=p["restart_exposed_s"],
            durable_s=p["durable_s"],
            stall_frac=p["data_stall_frac"],
        )
    )
    # A rate given on the command line has no observed interval.
    given = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0", "--mtbf-hours", "5")
    assert given["failure_rate_ci"] is None


def test_from_run_counts_the_first_start_up(tmp_path, capsys) -> None:
    make_run(tmp_path)
    days = 0.01  # 864 s: the first start-up is a visible share
    p = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0", "--days", str(days))
    s0 = p["first_startup_s"]
    assert s0 == pytest.approx(LedgerRun.STARTUP)  # the first attempt's start-up (no restore)
    assert p["goodput_exact_run"] == pytest.approx(p["goodput_exact"] * (1 - s0 / 864.0))
    month = plan_json(capsys, "--from-run", str(tmp_path), "--sim-runs", "0")
    assert math.isclose(month["goodput_run"], month["goodput"], rel_tol=1e-4)
    # Without a run there is no first start-up to charge.
    bare = plan_json(capsys, "--mtbf-hours", "5", "--sim-runs", "0")
    assert bare["first_startup_s"] == 0.0 and bare["goodput_run"] == bare["goodput"]


def test_human_output_shows_the_interval_and_the_first_start_up(tmp_path, capsys) -> None:
    from steadytrain.cli import main

    make_run(tmp_path)
    assert main(["plan", "--from-run", str(tmp_path), "--sim-runs", "0", "--days", "1"]) == 0
    out = capsys.readouterr().out
    assert "95% interval" in out and "first start-up" in out
