"""The two-tier planner (issue 28, item 3): a memory tier every K_m steps beside durable saves.

Limiting cases that pin the model down: with the tier off (or surviving no failure) it is the
existing first-order model exactly; free snapshots that survive every failure leave only the
restart from memory; a snapshot that costs nothing next to a step is taken every step. The
search is checked against brute force, and the recommendation is monotonic in what it should
be. Then ``steadytrain plan --two-tier`` prints both tiers at the seeds' and Llama 3 405B's
rates from one command, and plans from a run's own memory_snapshot and restore records.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from steadytrain.cli import main
from steadytrain.errors import ConfigError
from steadytrain.planning.interval import goodput_first_order
from steadytrain.planning.two_tier import (
    TierCosts,
    best_durable_interval_s,
    evaluate,
    goodput_two_tier,
    recommend,
)
from steadytrain.testing.synthetic import Timeline

LLAMA3_MTBF_S = 86400 / (466 / 54)


def costs(**kw: float) -> TierCosts:
    base = dict(
        step_s=6.0,
        memory_cost_s=0.5,
        memory_restore_s=10.0,
        durable_cost_s=30.0,
        restart_s=300.0,
        durable_restore_s=150.0,
        survives=0.75,
    )
    return TierCosts(**{**base, **kw})


secs = st.floats(0.0, 600.0)
tiers = st.builds(
    costs,
    step_s=st.floats(0.05, 60.0),
    memory_cost_s=st.floats(0.0, 30.0),
    memory_restore_s=secs,
    durable_cost_s=st.floats(0.0, 300.0),
    restart_s=secs,
    durable_restore_s=secs,
    survives=st.floats(0.0, 1.0),
    stall_frac=st.floats(0.0, 0.5),
)
mtbfs = st.floats(600.0, 1e8)


# -- limiting cases ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    tau=st.floats(1.0, 1e5),
    c=st.floats(0.0, 300.0),
    extra=st.floats(0.0, 600.0),
    r=secs,
    s=st.floats(0.0, 0.5),
    m=mtbfs,
    k=st.integers(1, 1000),
)
def test_memory_tier_off_or_surviving_nothing_is_the_durable_model(tau, c, extra, r, s, m, k):
    """The tier off is ``goodput_first_order`` exactly; so is a free tier that survives no
    failure (f = 0), at any K_m: the memory terms vanish, nothing else changes."""
    want = goodput_first_order(tau, c, m, r, c + extra, s)
    off = costs(durable_cost_s=c, durable_s=c + extra, restart_s=r, stall_frac=s)
    assert goodput_two_tier(None, tau, off, m) == pytest.approx(want, rel=1e-9, abs=1e-12)
    free_useless = costs(durable_cost_s=c, durable_s=c + extra, restart_s=r, stall_frac=s,
                         memory_cost_s=0.0, survives=0.0)  # fmt: skip
    assert goodput_two_tier(k, tau, free_useless, m) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("mtbf_s", [LLAMA3_MTBF_S, 86400 * 30.0])
def test_f0_recommends_durable_only(mtbf_s: float) -> None:
    c = costs(survives=0.0)
    rec = recommend(c, mtbf_s)
    assert rec["memory_every_steps"] is None  # snapshots cost and buy nothing
    assert rec["goodput"] == rec["durable_only"]["goodput"] and rec["gain"] == 0.0
    assert rec["durable_interval_min"] == rec["durable_only"]["durable_interval_min"]


@pytest.mark.parametrize("step_s", [1.0, 0.1, 0.001])
def test_free_snapshots_surviving_every_failure_leave_only_the_restart(step_s: float) -> None:
    """c_m = 0, f = 1: no durable save is needed for failures, a snapshot every step, and
    each failure costs the restart from memory and half a step; as steps shrink, goodput
    tends to 1 - restart/MTBF: the restore alone."""
    c = costs(step_s=step_s, memory_cost_s=0.0, survives=1.0, stall_frac=0.1)
    rec = recommend(c, LLAMA3_MTBF_S)
    assert rec["memory_every_steps"] == 1
    assert rec["durable_interval_min"] is None  # never, for failures
    assert rec["steps_lost_per_failure"] == pytest.approx(0.5)
    r_m = 300.0 - 150.0 + 10.0
    assert c.memory_restart_s == r_m
    want = 0.9 * (1.0 - (r_m + step_s / 2) / LLAMA3_MTBF_S)
    assert rec["goodput"] == pytest.approx(want, rel=1e-12)
    assert rec["goodput"] > rec["durable_only"]["goodput"] + 0.05


@pytest.mark.parametrize("mtbf_s", [LLAMA3_MTBF_S, 86400.0 * 30, 86400.0 * 365])
def test_a_snapshot_tiny_next_to_a_step_is_taken_every_step(mtbf_s: float) -> None:
    """Tiny means next to what one more step between snapshots loses: a second snapshot
    interval of ``t`` costs ``lambda f t^2 / 2`` of lost work per step, the snapshot
    ``c_m``. At a tenth of that, K_m = 1; at a hundred times it, K_m = sqrt(2 c_m /
    (lambda f)) / t steps (Young's rule on the memory tier's share of failures)."""
    t, f = 6.0, 0.75
    work = f * t * t / (2.0 * mtbf_s)
    rec = recommend(costs(memory_cost_s=0.1 * work), mtbf_s)
    assert rec["memory_every_steps"] == 1
    young = math.sqrt(2.0 * 100 * work * mtbf_s / f) / t  # = sqrt(100) = 10 steps
    assert recommend(costs(memory_cost_s=100 * work), mtbf_s)["memory_every_steps"] == round(young)
    # Work lost per memory-kind failure <= K steps (issue 28's target): half a step here.
    lost = evaluate(1, 1e9, costs(memory_cost_s=0.1 * work, survives=1.0), mtbf_s)
    assert lost["lost_per_failure_s"] == pytest.approx(t / 2, rel=1e-4)


def test_a_snapshot_that_lands_late_blocks_the_next_one() -> None:
    """One generation in flight: a snapshot due before the previous one landed waits, so a
    snapshot every step costs the landing time, not the staging (and K_m grows)."""
    fast = costs(memory_cost_s=0.05)
    slow = costs(memory_cost_s=0.05, memory_landed_s=30.0)
    assert goodput_two_tier(1, 1800.0, slow, LLAMA3_MTBF_S) < goodput_two_tier(
        1, 1800.0, fast, LLAMA3_MTBF_S
    )
    assert evaluate(1, 1800.0, slow, LLAMA3_MTBF_S)["blocking_share"] > 0.8
    assert recommend(slow, LLAMA3_MTBF_S)["memory_every_steps"] >= 5  # 30 s / 6 s


# -- the search ----------------------------------------------------------------------------


@pytest.mark.parametrize("mtbf_s", [LLAMA3_MTBF_S, 86400 * 4.0, 86400 * 120.0])
@pytest.mark.parametrize("c_m", [0.01, 0.5, 5.0])
def test_recommendation_beats_every_pair_on_a_grid(mtbf_s: float, c_m: float) -> None:
    c = costs(memory_cost_s=c_m)
    rec = recommend(c, mtbf_s)
    taus = [60.0 * m for m in (1, 2, 5, 10, 20, 30, 60, 120, 240, 480, 960, 1920)]
    ks = [None, *range(1, 60), *range(60, 3000, 37)]
    best = max(goodput_two_tier(k, tau, c, mtbf_s) for k in ks for tau in taus)
    assert rec["goodput"] >= best - 1e-12


@settings(max_examples=60, deadline=None)
@given(c=tiers, m=mtbfs, k=st.integers(1, 5000))
# Found by hypothesis: G still rose at the end of the storage piece (1.01 s beat the 1.0 s
# returned), and the edge itself is the memory piece's start, a step down.
@example(
    c=TierCosts(
        step_s=0.05,
        memory_cost_s=12.0,
        memory_restore_s=46.0,
        durable_cost_s=1.0,
        restart_s=0.0,
        durable_restore_s=0.0,
        survives=1.0,
    ),
    m=600.0,
    k=22,
)
def test_durable_interval_closed_form_is_the_maximum(c: TierCosts, m: float, k: int) -> None:
    tau = best_durable_interval_s(k, c, m)
    least = max(c.durable_cost_s, c.durable_s or 0.0)  # one save in flight
    g = goodput_two_tier(k, tau, c, m)
    finite = tau if math.isfinite(tau) else 1e7
    for x in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0, 10.0):
        if finite * x >= least:
            assert g >= goodput_two_tier(k, finite * x, c, m) - 1e-12


# -- monotonic -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(c=tiers, m=mtbfs)
def test_two_tiers_never_lose_to_durable_only(c: TierCosts, m: float) -> None:
    rec = recommend(c, m)
    assert rec["goodput"] >= rec["durable_only"]["goodput"] - 1e-12
    assert 0.0 <= rec["goodput"] <= 1.0


@settings(max_examples=40, deadline=None)
@given(c=tiers, m=mtbfs, df=st.floats(0.0, 1.0), more=st.floats(0.0, 10.0))
def test_more_survived_or_cheaper_snapshots_never_lower_goodput(c, m, df, more) -> None:
    g = recommend(c, m)["goodput"]
    if c.memory_restart_s <= c.restart_s:  # a restart from memory is not the slower one
        f2 = min(1.0, c.survives + df)
        assert recommend(TierCosts(**{**_fields(c), "survives": f2}), m)["goodput"] >= g - 1e-9
    dearer = TierCosts(**{**_fields(c), "memory_cost_s": c.memory_cost_s + more})
    assert recommend(dearer, m)["goodput"] <= g + 1e-9
    # more failures never help
    assert recommend(c, m / 2)["goodput"] <= g + 1e-9


def _fields(c: TierCosts) -> dict:
    d = c.to_dict()
    d.pop("memory_restart_s")
    return d


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="survives"):
        costs(survives=1.5)
    with pytest.raises(ConfigError, match="step_s"):
        costs(step_s=0.0)
    with pytest.raises(ConfigError, match="memory interval"):
        evaluate(0, 60.0, costs(), LLAMA3_MTBF_S)


# -- the command ---------------------------------------------------------------------------


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_one_command_compares_at_the_seeds_and_llama3_rates(capsys) -> None:
    r = plan_json(capsys, "--two-tier", "--sim-runs", "0")
    tt = r["two_tier"]
    names = [s["name"] for s in tt["scenarios"]]
    assert names == ["seeds 256", "seeds 1024", "Llama 3 405B"]
    rates = {s["name"]: s["interruptions_per_day"] for s in tt["scenarios"]}
    assert rates["seeds 256"] == pytest.approx(256 * 0.01 / 365)
    assert rates["seeds 1024"] == pytest.approx(1024 * 0.01 / 365)
    assert rates["Llama 3 405B"] == pytest.approx(466 / 54)
    for s in tt["scenarios"]:
        assert s["goodput"] >= s["durable_only"]["goodput"]
    llama = tt["scenarios"][2]
    assert llama["gain"] > 0.02  # the memory tier pays most where failures are frequent
    assert llama["gain"] > tt["scenarios"][0]["gain"]
    # The durable tier's costs are the plan's own: durable-only here is the plan's model.
    assert tt["costs"]["durable_cost_s"] == r["ckpt_cost_s"]
    assert tt["costs"]["restart_s"] == r["restart_cost_s"]
    assert set(tt["sources"].values()) == {"default"}
    text = _text(capsys, "--two-tier", "--sim-runs", "0")
    assert "two tiers against durable-only" in text
    assert "Llama 3 405B" in text and "seeds 1024" in text
    assert "[checkpoint.memory] every_steps =" in text


def _text(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_given_costs_win_and_a_tier_flag_implies_two_tier(capsys) -> None:
    r = plan_json(
        capsys, "--memory-cost", "0.00001", "--step-time", "2", "--memory-survives", "1",
        "--memory-restore", "3", "--durable-restore", "100", "--sim-runs", "0",
        "--interruptions-per-day", "8.6",
    )  # fmt: skip
    tt = r["two_tier"]
    assert tt["sources"] == dict.fromkeys(
        ("step_s", "memory_cost_s", "memory_restore_s", "durable_restore_s", "survives"), "given"
    )
    assert tt["memory_every_steps"] == 1 and tt["durable_interval_min"] is None
    assert tt["costs"]["memory_restart_s"] == pytest.approx(300 - 100 + 3)


def _run_with_tiers(run: Path) -> Path:
    """A ledger of a run with the memory tier on: 2 s steps, snapshots blocking 0.02 s,
    landing 0.1 s later; one restore from local memory (0.5 s), one from a peer (1.5 s),
    one from durable storage (9 s)."""
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0, startup_s=1.0)
    step = 0
    for attempt, (tier, secs) in enumerate(
        [(None, 0.0), ("local-memory", 0.5), ("peer-memory", 1.5), ("durable", 9.0)]
    ):
        if tier is not None:
            tl.advance(20.0)
            restored = {"local-memory": step, "peer-memory": step - 1}.get(tier, 10)
            tl.job_start(attempt=attempt, restored_step=restored, startup_s=1.0, restore_s=secs)
            tl.event({"type": "restore", "step": restored, "restore_s": secs, "tier": tier})
            step = restored
        for _ in range(10):
            step += 1
            tl.step(step, tokens=100, data_wait_s=0.0, compute_s=1.98, checkpoint_block_s=0.02,
                    other_s=0.0, saved=step % 10 == 0)  # fmt: skip
            tl.event({"type": "memory_snapshot", "step": step, "ok": True, "block_s": 0.02,
                      "write_s": 0.05, "peer_s": 0.03, "bytes": 10, "peer_bytes": 10})  # fmt: skip
    run.mkdir()
    with open(run / "ledger.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in tl.records)
    return run


def test_from_run_uses_the_snapshot_and_restore_records(capsys, tmp_path: Path) -> None:
    run = _run_with_tiers(tmp_path / "run")
    r = plan_json(capsys, "--from-run", str(run), "--two-tier", "--sim-runs", "0")
    tt = r["two_tier"]
    assert tt["sources"] == dict.fromkeys(
        ("step_s", "memory_cost_s", "memory_restore_s", "durable_restore_s", "survives"),
        "measured",
    )
    c = tt["costs"]
    assert c["step_s"] == pytest.approx(1.98)
    assert c["memory_cost_s"] == pytest.approx(0.02)
    assert tt["measured"]["memory_cost_from"] == "block_s"
    assert c["memory_landed_s"] == pytest.approx(0.1)
    assert c["memory_restore_s"] == pytest.approx(1.0)  # mean of 0.5 and 1.5
    assert c["durable_restore_s"] == pytest.approx(9.0)
    assert c["survives"] == pytest.approx(2 / 3)
    assert tt["measured"]["restores"] == {"local-memory": 1, "peer-memory": 1, "durable": 1}
    assert tt["memory_every_steps"] is not None


def test_from_run_prefers_the_cost_the_tier_measured(capsys, tmp_path: Path) -> None:
    """A run with ``every_steps = "auto"`` measured a snapshot's whole cost to the loop
    (blocking plus interference): the plan uses that, not the blocking alone."""
    run = _run_with_tiers(tmp_path / "run")
    ledger = run / "ledger.jsonl"
    recs = [json.loads(line) for line in ledger.read_text().splitlines()]
    snap = next(r for r in recs if r["type"] == "memory_snapshot")
    snap["every_steps"] = 7
    snap["auto"] = {"step_s": 1.98, "cost_s": 0.4, "interference_s": 0.38, "landed_s": 0.1}
    ledger.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = ["--two-tier", "--sim-runs", "0"]
    r = plan_json(capsys, "--from-run", str(run), *args)
    tt = r["two_tier"]
    assert tt["costs"]["memory_cost_s"] == pytest.approx(0.4)
    assert tt["measured"]["memory_cost_from"] == "auto.cost_s"
    # (a dearer snapshot gets a longer interval: test_a_snapshot_tiny_next_to_a_step_...)
    assert tt["costs"]["memory_landed_s"] == pytest.approx(0.1)  # still the records' own
