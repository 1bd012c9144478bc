"""The one plan function: a run's measured costs, the flags given, the defaults -> a plan.

``steadytrain plan`` (with or without ``--from-run``) and ``steadytrain demo`` both call
``plan_from_run``, so a run directory gives the same numbers wherever it is planned from.
Every cost the model has comes from one of three places, in this order, and ``sources``
in the result says which: a value given by the caller, the value measured in the run's
ledger (``measure_run``), or the default. The data stall share is one of those costs: a run
that waited for data plans with that wait (it is badput the plan reports under
``badput.data_wait``).

Measured against a run (issue 13), the plan has to say three more things. The failure rate
a run observed is a rate over the time its attempts were up (``measure_run``), and failures
can hit only the exposed part ``U`` of a measured restart, not its dead time: the exact
goodput uses both (``restart_exposed_s``; a restart cost given by the caller is exposed
whole, Daly's model). The rate is an estimate from a few failures: ``failure_rate_ci``
gives its exact 95 % Poisson interval and the goodput at either end (at the same
interval). And a run pays its first start-up ``S0`` once, outside the model's steady
state (a steady state entered at a failure pays one restart more than ``W / goodput`` for
``W`` kept seconds; the first attempt pays ``S0`` in its place), so over a run of ``T =
--days``, ``goodput_run`` (and ``goodput_exact_run``) are ``goodput x (1 - S0 / T)`` --
nothing for a month, much of the gap for a minute-long benchmark run.
"""

from __future__ import annotations

import os
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.planning.interval import goodput_exact, goodput_first_order
from steadytrain.planning.run_costs import RunCosts, measure_run
from steadytrain.planning.summary import choose_failure_model, make_plan

__all__ = ["DEFAULT_CKPT_COST_S", "DEFAULT_RESTART_COST_S", "plan_from_run"]

DEFAULT_CKPT_COST_S = 30.0
DEFAULT_RESTART_COST_S = 300.0


def _pick(
    given: float | None, measured: float | None, default: float, name: str, src: dict[str, str]
) -> float:
    for value, how in ((given, "given"), (measured, "measured")):
        if value is not None:
            src[name] = how
            return value
    src[name] = "default"
    return default


def plan_from_run(
    run_dir: str | os.PathLike[str] | None,
    *,
    measured: RunCosts | None = None,
    gpus: int | None = None,
    afr: float | None = None,
    mtbf_hours: float | None = None,
    interruptions_per_day: float | None = None,
    days: float = 30.0,
    ckpt_cost_s: float | None = None,
    durable_s: float | None = None,
    async_ckpt_cost_s: float | None = None,
    restart_cost_s: float | None = None,
    data_stall_frac: float | None = None,
    interval_min: float | None = None,
    simulate_runs: int = 2000,
    seed: int = 0,
    failure_shape: float = 1.0,
) -> dict[str, Any]:
    """The plan for ``run_dir``'s measured costs, as ``steadytrain plan --json`` prints it.

    ``run_dir=None`` plans from the given values and defaults alone (``plan`` without
    ``--from-run``). ``measured``: costs already measured from ``run_dir`` (skips reading its
    ledger again). Keyword values override what was measured; the failure rate is given at
    most one way (``afr`` with ``gpus``, ``mtbf_hours`` or ``interruptions_per_day``), else
    the run's observed rate, else the default. ``durable_s`` follows ``ckpt_cost_s``: a given
    save cost is not mixed with a measured durability time.
    """
    if interval_min is not None and not interval_min > 0:
        raise ConfigError(f"--interval {interval_min:g} must be a positive number of minutes")
    if not days > 0:
        raise ConfigError(f"--days {days:g} must be positive")
    m = measured if measured is not None or run_dir is None else measure_run(run_dir)
    model, notes = choose_failure_model(gpus, afr, mtbf_hours, interruptions_per_day, m)
    src: dict[str, str] = {}
    ckpt = _pick(ckpt_cost_s, m.ckpt_cost_s if m else None, DEFAULT_CKPT_COST_S, "ckpt_cost_s", src)
    durable = durable_s
    if durable is None and m is not None and ckpt_cost_s is None:
        durable = m.durable_s
    restart = _pick(
        restart_cost_s,
        m.restart_cost_s if m else None,
        DEFAULT_RESTART_COST_S,
        "restart_cost_s",
        src,
    )
    stall = _pick(data_stall_frac, m.data_stall_frac if m else None, 0.0, "data_stall_frac", src)
    # Only a measured restart has a measured exposed part; a given one is exposed whole.
    exposed = m.restart_exposed_s if m is not None and src["restart_cost_s"] == "measured" else None
    result = make_plan(
        model,
        days=days,
        ckpt_cost_s=ckpt,
        durable_s=durable,
        async_ckpt_cost_s=async_ckpt_cost_s,
        restart_s=restart,
        interval_s=interval_min * 60.0 if interval_min is not None else None,
        stall_frac=stall,
        simulate_runs=simulate_runs,
        seed=seed,
        failure_shape=failure_shape,
        restart_exposed_s=exposed,
    )
    result["sources"] = src
    result["notes"] = notes + result["notes"]
    observed = m is not None and model.source.startswith("observed")
    result["failure_rate_ci"] = _rate_ci(result, m) if observed else None
    s0 = m.first_startup_s if m is not None else 0.0
    result["first_startup_s"] = s0
    keep = max(0.0, 1.0 - s0 / (days * 86400.0))
    result["goodput_run"] = result["goodput"] * keep
    result["goodput_exact_run"] = result["goodput_exact"] * keep
    if m is not None:
        result["measured"] = m.to_dict()
    return result


def _rate_ci(plan: dict[str, Any], m: RunCosts) -> dict[str, Any] | None:
    """The observed rate's 95 % interval and the goodput at its ends, at the plan's interval
    (a higher rate gives the lower goodput: ``goodput`` is [low, high])."""
    if m.interruptions_per_day_ci is None or plan["interval_min"] is None:
        return None
    lo, hi = m.interruptions_per_day_ci
    tau = plan["interval_min"] * 60.0
    args = (plan["ckpt_cost_s"],)
    kw = {
        "restart_s": plan["restart_cost_s"],
        "restart_exposed_s": plan["restart_exposed_s"],
        "durable_s": plan["durable_s"],
        "stall_frac": plan["data_stall_frac"],
    }

    def at(per_day: float) -> tuple[float, float]:
        mtbf = 86400.0 / per_day if per_day > 0 else float("inf")
        first = {k: v for k, v in kw.items() if k != "restart_exposed_s"}
        return goodput_first_order(tau, *args, mtbf, **first), goodput_exact(tau, *args, mtbf, **kw)

    worst, best = at(hi), at(lo)
    return {
        "confidence": 0.95,
        "interruptions": m.interruptions,
        "interruptions_per_day": [lo, hi],
        "goodput": [worst[0], best[0]],
        "goodput_exact": [worst[1], best[1]],
    }
