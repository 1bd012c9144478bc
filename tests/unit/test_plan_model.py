"""Planner closed forms: failure model, Young/Daly/exact intervals, goodput."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steadytrain.errors import ConfigError
from steadytrain.planning import (
    FailureModel,
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    optimal_interval_s,
    time_shares_first_order,
    young_interval_s,
)

HOUR = 3600.0


# -- failure model: the reference points of the issue, within 1 percentage point ---------


def test_afr_reference_points():
    assert FailureModel.from_afr(256, 0.01).p_failure(30) == pytest.approx(0.19, abs=0.01)
    assert FailureModel.from_afr(1024, 0.01).p_failure(30) == pytest.approx(0.57, abs=0.01)
    # exactly 1 - exp(-N * afr * D / 365)
    assert FailureModel.from_afr(256, 0.01).p_failure(30) == pytest.approx(
        1 - math.exp(-256 * 0.01 * 30 / 365), rel=1e-12
    )


def test_three_ways_to_give_the_rate_agree():
    a = FailureModel.from_afr(16384, 8.6 * 365 / 16384)
    b = FailureModel.from_interruptions_per_day(8.6)
    c = FailureModel.from_mtbf_hours(24 / 8.6)
    for m in (a, b, c):
        assert m.interruptions_per_day == pytest.approx(8.6)
        assert m.mtbf_hours == pytest.approx(24 / 8.6)
        assert m.expected_interruptions(54) == pytest.approx(8.6 * 54)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FailureModel.from_afr(0, 0.01),
        lambda: FailureModel.from_afr(8, -1),
        lambda: FailureModel.from_mtbf_hours(0),
        lambda: FailureModel.from_interruptions_per_day(float("nan")),
    ],
)
def test_bad_rates_are_config_errors(make):
    with pytest.raises(ConfigError, match="must be a positive number"):
        make()


def test_llama3_goodput_reference_points():
    """8.6 interruptions/day, free saves, lost work of half an interval per failure."""
    m = FailureModel.from_interruptions_per_day(8.6).mtbf_s
    assert goodput_first_order(2 * HOUR, 0, m) == pytest.approx(0.64, abs=0.01)
    assert goodput_first_order(0.5 * HOUR, 0, m) == pytest.approx(0.91, abs=0.01)
    assert goodput_first_order(2 * HOUR, 0, m) == pytest.approx(1 - 8.6 * 1 / 24, rel=1e-12)
    assert goodput_first_order(0.5 * HOUR, 0, m) == pytest.approx(1 - 8.6 * 0.25 / 24, rel=1e-12)


# -- intervals, against hand-computed values ----------------------------------------------


def test_young_by_hand():
    assert young_interval_s(50, 10_000) == pytest.approx(1000.0)


def test_daly_by_hand():
    # sqrt(2*50*10000) * (1 + sqrt(0.0025)/3 + 0.0025/9) - 50
    assert daly_interval_s(50, 10_000) == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert daly_interval_s(50, 10_000) == pytest.approx(966.944, abs=1e-3)
    assert daly_interval_s(300, 100) == 100  # C >= 2M: checkpoint once per MTBF


def test_exact_interval_is_the_root_and_daly_approximates_it():
    c, m = 60.0, 45 * HOUR
    tau = exact_interval_s(c, m)
    assert tau / m == pytest.approx(-math.expm1(-(tau + c) / m), rel=1e-9)
    assert tau == pytest.approx(daly_interval_s(c, m), rel=1e-4)
    assert tau == pytest.approx(young_interval_s(c, m), rel=0.02)
    assert exact_interval_s(0.0, m) == 0.0


def test_optimal_interval_contract():
    # The checkpointer's auto interval: exact optimum, floored at the time to durability.
    c, m = 60.0, 45 * HOUR
    assert optimal_interval_s(c, m) == pytest.approx(exact_interval_s(c, m))
    assert optimal_interval_s(c, m, restart_s=900.0) == optimal_interval_s(c, m)  # Daly: R-free
    assert optimal_interval_s(2.0, m, durable_s=7200.0) == 7200.0  # tau >= L
    assert optimal_interval_s(c, math.inf) == math.inf
    with pytest.raises(ConfigError, match="mtbf_s"):
        optimal_interval_s(c, 0.0)
    with pytest.raises(ConfigError, match="ckpt_cost_s"):
        optimal_interval_s(-1.0, m)


# -- goodput, against hand-computed values ------------------------------------------------


def test_first_order_by_hand_sync_and_async():
    # sync: P = 3060, lost = R + P/2 = 600 + 1530
    assert goodput_first_order(3000, 60, 36000, 600) == pytest.approx(
        3000 / 3060 * (1 - 2130 / 36000)
    )
    # async: P = 1805, lost = R + P/2 + L - C = 300 + 902.5 + 115
    assert goodput_first_order(1800, 5, 36000, 300, 120) == pytest.approx(
        1800 / 1805 * (1 - 1317.5 / 36000)
    )
    # data stalls take their share of compute time
    assert goodput_first_order(1800, 5, 36000, 300, 120, 0.1) == pytest.approx(
        0.9 * 1800 / 1805 * (1 - 1317.5 / 36000)
    )


def test_exact_is_dalys_model_for_sync_saves():
    tau, c, m, r = 3000.0, 60.0, 36000.0, 600.0
    daly = tau / (m * math.exp(r / m) * (math.exp((tau + c) / m) - 1))
    assert goodput_exact(tau, c, m, r) == pytest.approx(daly, rel=1e-12)
    # async: the first checkpoint after a restart needs tau + L, later ones tau + C each
    l_s = 300.0
    lam = 1 / m
    hand = tau * lam * math.exp(-lam * (r + tau + l_s)) / (1 - math.exp(-lam * (tau + c)))
    assert goodput_exact(tau, c, m, r, l_s) == pytest.approx(hand, rel=1e-12)


def test_free_continuous_saves_limit():
    m = 10 * HOUR
    assert goodput_exact(0.0, 0.0, m, 600.0) == pytest.approx(math.exp(-600 / m))
    assert goodput_exact(1e-6, 0.0, m, 600.0) == pytest.approx(math.exp(-600 / m), rel=1e-6)
    assert goodput_first_order(0.0, 0.0, m, 600.0) == pytest.approx(1 - 600 / m)


def test_short_interval_waits_for_the_previous_save():
    # tau < L - C: the loop waits for the save in flight, so goodput only falls.
    m = 10 * HOUR
    assert goodput_exact(60, 1, m, 0, 600) < goodput_exact(600, 1, m, 0, 600)


# -- properties ------------------------------------------------------------------------

costs = st.floats(min_value=0.1, max_value=3600.0)
mtbfs = st.floats(min_value=600.0, max_value=1e7)


@settings(max_examples=200, deadline=None)
@given(
    c=costs,
    m=mtbfs,
    r=st.floats(min_value=0.0, max_value=3600.0),
    extra=st.floats(min_value=0.0, max_value=3600.0),
    ratio=st.floats(min_value=0.01, max_value=100.0),
)
def test_optimal_interval_maximises_exact_goodput(c, m, r, extra, ratio):
    l_s = c + extra
    best = optimal_interval_s(c, m, r, l_s)
    g_best = goodput_exact(best, c, m, r, l_s)
    other = max(l_s, best * ratio)
    assert g_best >= goodput_exact(other, c, m, r, l_s) * (1 - 1e-12)
    # and the neighbours on either side (allowed ones) are no better
    for tau in (best * 0.99, best * 1.01):
        if tau >= l_s:
            assert g_best >= goodput_exact(tau, c, m, r, l_s) * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    tau=st.floats(min_value=1.0, max_value=1e6),
    c=costs,
    m=mtbfs,
    r=st.floats(min_value=0.0, max_value=3600.0),
    extra=st.floats(min_value=0.0, max_value=3600.0),
)
def test_first_order_is_a_lower_bound_of_exact(tau, c, m, r, extra):
    l_s = c + extra
    g1 = goodput_first_order(tau, c, m, r, l_s)
    g = goodput_exact(tau, c, m, r, l_s)
    assert 0.0 <= g1 <= g * (1 + 1e-12) <= 1.0 + 1e-12


@settings(max_examples=100, deadline=None)
@given(c=st.floats(min_value=1e-3, max_value=600.0), m=st.floats(min_value=3600.0, max_value=1e8))
def test_daly_close_to_exact_when_saves_are_cheap(c, m):
    # Daly's expansion is within a fraction of a percent while C << M.
    if c / m < 1e-2:
        assert daly_interval_s(c, m) == pytest.approx(exact_interval_s(c, m), rel=2e-3)


@settings(max_examples=200, deadline=None)
@given(
    tau=st.floats(min_value=0.0, max_value=1e6),
    c=st.floats(min_value=0.0, max_value=3600.0),
    m=st.floats(min_value=60.0, max_value=1e7),
    r=st.floats(min_value=0.0, max_value=3600.0),
    extra=st.floats(min_value=0.0, max_value=3600.0),
    s=st.floats(min_value=0.0, max_value=0.9),
)
def test_time_shares_account_for_all_wall_time(tau, c, m, r, extra, s):
    # The plan's badput by bucket and its goodput cover the wall time exactly once, and the
    # goodput is the first-order goodput, even where it floors at 0 or the loop waits for
    # the previous save (tau < L - C).
    shares = time_shares_first_order(tau, c, m, r, c + extra, s)
    assert set(shares) == {
        "goodput",
        "data_wait",
        "checkpoint_block",
        "restart",
        "lost_to_failures",
    }
    assert min(shares.values()) >= 0.0
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert shares["goodput"] == pytest.approx(
        goodput_first_order(tau, c, m, r, c + extra, s), abs=1e-12
    )


def test_time_shares_by_hand():
    # M = 10 h, tau = 50 min, C = 60 s (sync), R = 600 s, s = 10 %: P = 3060 s,
    # r = 600/36000, w = (1530 s)/36000.
    m, tau, c, r, s = 10 * HOUR, 3000.0, 60.0, 600.0, 0.1
    shares = time_shares_first_order(tau, c, m, r, c, s)
    p, rr, w = tau + c, r / m, (tau + c) / 2 / m
    assert shares["restart"] == pytest.approx(rr)
    assert shares["checkpoint_block"] == pytest.approx((1 - rr) * c / p)
    assert shares["data_wait"] == pytest.approx((1 - rr) * tau * s / p)
    assert shares["lost_to_failures"] == pytest.approx(w * tau * (1 - s) / p)
    # a data stall moves time from goodput to data_wait and nowhere else
    clean = time_shares_first_order(tau, c, m, r, c, 0.0)
    assert clean["data_wait"] == 0.0
    assert shares["goodput"] == pytest.approx(clean["goodput"] * (1 - s))
    for k in ("restart", "checkpoint_block"):
        assert shares[k] == pytest.approx(clean[k])
