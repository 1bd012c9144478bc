"""Monte-Carlo simulator against the closed forms: agreement where they hold, not elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from steadytrain.errors import ConfigError
from steadytrain.planning import FailureModel, goodput_exact, simulate
from steadytrain.planning.montecarlo import _secured

HOUR = 3600.0
LLAMA_M = FailureModel.from_interruptions_per_day(8.6).mtbf_s


@pytest.mark.parametrize(
    "case",
    [
        # Llama 3 rate, free saves: 2 h and 30 min
        dict(interval_s=2 * HOUR, ckpt_cost_s=0.0, mtbf_s=LLAMA_M),
        dict(interval_s=0.5 * HOUR, ckpt_cost_s=0.0, mtbf_s=LLAMA_M),
        # sync saves with restarts
        dict(interval_s=3000.0, ckpt_cost_s=60.0, mtbf_s=10 * HOUR, restart_s=600.0),
        # async saves: L > C, failures that hit a save in flight go back one more checkpoint
        dict(interval_s=1200.0, ckpt_cost_s=5.0, mtbf_s=4 * HOUR, restart_s=300.0, durable_s=900.0),
        # constant data stall share
        dict(interval_s=1800.0, ckpt_cost_s=30.0, mtbf_s=6 * HOUR, stall_frac=0.2, stall_cv=0.0),
    ],
)
def test_simulation_agrees_with_exact_closed_form(case):
    sim = simulate(**case, days=30, runs=1000, seed=7)
    exact = goodput_exact(
        case["interval_s"],
        case["ckpt_cost_s"],
        case["mtbf_s"],
        case.get("restart_s", 0.0),
        case.get("durable_s", 0.0),
        case.get("stall_frac", 0.0),
    )
    assert sim.exact_applies
    assert sim.closed_form_exact == pytest.approx(exact)
    assert abs(sim.mean - exact) <= 3.29 * sim.stderr, sim  # the 99.9 % interval
    assert sim.exact_agrees
    assert sim.ci95[1] - sim.ci95[0] < 0.01  # the CI is tight enough to mean something
    # the per-run distribution over 30 days sits around it
    assert sim.p5 <= exact + 0.01 and sim.p95 >= exact - 0.01


def test_first_order_breaks_down_when_interval_nears_mtbf():
    """Llama 3, 2 h interval: the first-order 64 % is a lower bound; simulation says ~68 %."""
    sim = simulate(2 * HOUR, 0.0, LLAMA_M, days=30, runs=1000, seed=1)
    assert sim.closed_form_first_order == pytest.approx(0.6417, abs=1e-3)
    assert not sim.first_order_agrees
    assert sim.mean - sim.closed_form_first_order > 0.03
    # and it holds when the interval is small against the MTBF
    sim = simulate(600.0, 10.0, 20 * HOUR, restart_s=300.0, days=30, runs=1000, seed=1)
    assert sim.first_order_agrees or abs(sim.mean - sim.closed_form_first_order) < 2e-3


def test_bursty_failures_leave_the_closed_form():
    """Weibull gaps (shape 0.5, same mean): failures cluster, often inside the restart."""
    case = dict(interval_s=1800.0, ckpt_cost_s=10.0, mtbf_s=LLAMA_M, restart_s=600.0)
    poisson = simulate(**case, runs=1000, seed=3)
    bursty = simulate(**case, runs=1000, seed=3, failure_shape=0.5)
    assert poisson.exact_agrees
    assert not bursty.exact_applies
    assert not bursty.exact_agrees
    assert abs(bursty.mean - bursty.closed_form_exact) > 0.01


def test_random_stalls_are_simulated_by_the_gamma_bridge():
    case = dict(interval_s=1800.0, ckpt_cost_s=10.0, mtbf_s=LLAMA_M, stall_frac=0.1)
    steady = simulate(**case, stall_cv=0.0, runs=500, seed=5)
    noisy = simulate(**case, stall_cv=1.5, runs=500, seed=5)
    assert steady.exact_agrees
    assert not noisy.exact_applies
    # same mean stall, so the same goodput to within a few tenths of a percent
    assert noisy.mean == pytest.approx(steady.mean, abs=0.01)
    # noisy segment durations spread the 30-day outcomes
    assert noisy.p95 - noisy.p5 > steady.p95 - steady.p5


def test_secured_count_bisection_matches_direct_simulation():
    """The Gamma-bridge bisection is the first-passage count of the stall random walk."""
    rng = np.random.default_rng(11)
    seg, c, w, cv, y = 100.0, 10.0, 0.3, 1.0, 2000.0
    n = 20000
    fast = _secured(np.full(n, y), seg, c, w, cv, rng)
    steps = seg * (1 + w * rng.gamma(1 / cv**2, cv**2, size=(n, 40))) + c
    direct = (np.cumsum(steps, axis=1) <= y).sum(axis=1)
    assert fast.mean() == pytest.approx(direct.mean(), abs=0.05)
    assert np.bincount(fast, minlength=20)[:20] == pytest.approx(
        np.bincount(direct, minlength=20)[:20], abs=0.02 * n
    )


def test_seeded_and_reproducible():
    a = simulate(1800.0, 10.0, LLAMA_M, restart_s=60.0, runs=200, seed=42)
    b = simulate(1800.0, 10.0, LLAMA_M, restart_s=60.0, runs=200, seed=42)
    c = simulate(1800.0, 10.0, LLAMA_M, restart_s=60.0, runs=200, seed=43)
    assert a == b
    assert a.mean != c.mean


def test_rare_failures_most_runs_see_none():
    # 256 GPUs at 1 %/GPU-year: 19 % of 30-day runs see a failure.
    m = FailureModel.from_afr(256, 0.01).mtbf_s
    sim = simulate(3600.0, 30.0, m, restart_s=600.0, days=30, runs=2000, seed=2)
    # no failure: only save overhead and the start-up
    assert sim.p50 == pytest.approx(3600 / 3630 - 600 / (30 * 86400), abs=2e-4)
    assert sim.interruptions_mean == pytest.approx(0.21, abs=0.04)


def test_bad_simulation_inputs():
    with pytest.raises(ConfigError, match="interval"):
        simulate(0.0, 1.0, HOUR)
    with pytest.raises(ConfigError, match="runs >= 2"):
        simulate(60.0, 1.0, HOUR, runs=1)
