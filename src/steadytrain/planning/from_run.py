"""The one plan function: a run's measured costs, the flags given, the defaults -> a plan.

``steadytrain plan`` (with or without ``--from-run``) and ``steadytrain demo`` both call
``plan_from_run``, so a run directory gives the same numbers wherever it is planned from.
Every cost the model has comes from one of three places, in this order, and ``sources``
in the result says which: a value given by the caller, the value measured in the run's
ledger (``measure_run``), or the default. The data stall share is one of those costs: a run
that waited for data plans with that wait (it is badput the plan reports under
``badput.data_wait``).
"""

from __future__ import annotations

import os
from typing import Any

from steadytrain.errors import ConfigError
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
    )
    result["sources"] = src
    result["notes"] = notes + result["notes"]
    if m is not None:
        result["measured"] = m.to_dict()
    return result
