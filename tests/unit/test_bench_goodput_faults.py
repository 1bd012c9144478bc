"""bench/goodput_faults.py's a-priori prediction: the planner's long-run goodput at the
nominal failure rate with the calibration run's costs, over the benchmark run's length with
the calibration's first start-up. A prediction that dropped the start-up (the earlier
"nominal" figure, 15 points high) or used the run's own costs would fail here."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

from steadytrain.planning import goodput_exact

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gf", f"{BENCH}/goodput_faults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CAL = {
    "compute_s_per_step": 0.5, "ckpt_block_s": 0.05, "ckpt_durable_s": 0.05,
    "restart_s": 12.0, "restart_exposed_s": 4.0, "data_stall_frac": 0.01,
    "first_startup_s": 0.0,
}  # fmt: skip


def test_a_priori_is_the_planners_goodput_at_the_nominal_rate(bench):
    args = argparse.Namespace(every=2, mtbf=90.0, steps=100)
    got = bench.a_priori(CAL, args)
    want = goodput_exact(1.0, 0.05, 90.0, restart_s=12.0, durable_s=0.05, stall_frac=0.01,
                         restart_exposed_s=4.0)  # fmt: skip
    assert got["long_run"] == pytest.approx(want) and got["run"] == pytest.approx(want)
    assert got["interval_s"] == 1.0
    # a faster failure rate predicts less: the nominal rate is what is plugged in
    assert bench.a_priori(CAL, argparse.Namespace(every=2, mtbf=30.0, steps=100))["run"] < want


def test_a_priori_counts_the_first_start_up_over_the_runs_length(bench):
    args = argparse.Namespace(every=2, mtbf=90.0, steps=100)
    g = bench.a_priori(CAL, args)["long_run"]
    got = bench.a_priori(CAL | {"first_startup_s": 10.0}, args)["run"]
    work = 100 * 0.5
    assert got == pytest.approx(work / (work / g + 10.0)) and got < g - 0.05


def test_each_attempts_first_step_is_left_out(bench):
    recs = [
        {"type": "job_start"}, {"type": "step", "step": 1}, {"type": "step", "step": 2},
        {"type": "checkpoint"}, {"type": "step", "step": 3},
        {"type": "job_start"}, {"type": "step", "step": 3}, {"type": "step", "step": 4},
    ]  # fmt: skip
    assert [r["step"] for r in bench.first_steps_left_out(recs)] == [2, 3, 4]
