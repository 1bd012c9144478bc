"""One planning answer: failure odds, best interval, goodput per interval and save mode.

``make_plan`` is what ``steadytrain plan`` prints; everything in it is plain JSON.
Save modes: *sync* blocks until the checkpoint is durable (``C = L``); *async* blocks only
for the copy to host memory (``C_async``) and lands ``L`` after the save started. When the
inputs are synchronous and no asynchronous cost is known, ``C_async = C / 10`` is assumed
(staging to pinned host memory is a memory copy, the write is the slow part) and marked so.
``badput`` says where the wall time goes at the evaluated interval under the first-order
model, in the report's bucket names, so a plan can be read against a run's measured badput.
"""

from __future__ import annotations

import math
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.planning.failures import LLAMA3_AFR, FailureModel
from steadytrain.planning.interval import (
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    optimal_interval_s,
    time_shares_first_order,
    young_interval_s,
)

__all__ = [
    "ASYNC_BLOCK_SHARE",
    "DEFAULT_GPUS",
    "TABLE_MINUTES",
    "choose_failure_model",
    "make_plan",
    "save_modes",
]

ASYNC_BLOCK_SHARE = 0.1
DEFAULT_GPUS = 1024
TABLE_MINUTES = (5, 10, 15, 30, 60, 120, 240)


def choose_failure_model(
    gpus: int | None = None,
    afr: float | None = None,
    mtbf_hours: float | None = None,
    interruptions_per_day: float | None = None,
    measured: Any = None,
) -> tuple[FailureModel, list[str]]:
    """The failure model the user asked for, or the run's observed rate, or the default.

    At most one of ``afr``, ``mtbf_hours``, ``interruptions_per_day``. ``measured`` is a
    ``RunCosts`` (``--from-run``): its interruption rate is used when no rate is given.
    Returns the model and notes on what was assumed.
    """
    given = {
        "--afr": afr,
        "--mtbf-hours": mtbf_hours,
        "--interruptions-per-day": interruptions_per_day,
    }
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1:
        raise ConfigError(
            f"{' and '.join(named)} both give the failure rate; give only one of them"
        )
    if gpus is not None and named and named[0] != "--afr":
        raise ConfigError(
            f"--gpus scales a per-GPU rate (--afr) but {named[0]} is already the rate of the "
            "whole job; drop --gpus, or give a per-GPU rate as --afr (8760 / per-GPU MTBF hours)"
        )
    notes: list[str] = []
    if mtbf_hours is not None:
        return FailureModel.from_mtbf_hours(mtbf_hours), notes
    if interruptions_per_day is not None:
        return FailureModel.from_interruptions_per_day(interruptions_per_day), notes
    if afr is None and gpus is None and measured is not None:
        if measured.interruptions_per_day is not None:
            model = FailureModel.from_interruptions_per_day(measured.interruptions_per_day)
            src = f"{measured.interruptions} interruptions in {measured.wall_days * 24:.3g} h"
            return FailureModel(model.rate_per_hour, f"observed in {measured.ledger}: {src}"), notes
        notes.append(
            f"{measured.ledger} shows no interruption in {measured.wall_days * 24:.3g} h; "
            "using the default failure rate (give --afr, --mtbf-hours or "
            "--interruptions-per-day to set it)"
        )
    if gpus is None:
        gpus = (measured.world_size if measured is not None else None) or DEFAULT_GPUS
        notes.append(f"assumed --gpus {gpus}")
    if afr is None:
        afr = LLAMA3_AFR
        notes.append(
            f"assumed --afr {afr:.3f} (Llama 3: 466 interruptions in 54 days on 16,384 GPUs)"
        )
    return FailureModel.from_afr(gpus, afr), notes


def save_modes(
    ckpt_cost_s: float, durable_s: float | None, async_ckpt_cost_s: float | None
) -> tuple[str, dict[str, dict[str, Any]]]:
    """(mode the inputs describe, {mode: {ckpt_cost_s, durable_s, assumed}})."""
    durable = max(ckpt_cost_s, durable_s if durable_s is not None else ckpt_cost_s)
    given = "async" if durable > ckpt_cost_s else "sync"
    if given == "async":
        c_async, assumed = ckpt_cost_s, False
    elif async_ckpt_cost_s is not None:
        c_async, assumed = min(async_ckpt_cost_s, durable), False
    else:
        c_async, assumed = ckpt_cost_s * ASYNC_BLOCK_SHARE, True
    modes = {
        "sync": {"ckpt_cost_s": durable, "durable_s": durable, "assumed": False},
        "async": {"ckpt_cost_s": c_async, "durable_s": durable, "assumed": assumed},
    }
    return given, modes


def _minutes(seconds: float) -> float | None:
    return None if math.isinf(seconds) else seconds / 60.0


def _badput(tau: float, c: float, m: float, kw: dict[str, float]) -> dict[str, float]:
    """The first-order badput at ``tau`` by bucket (``goodput`` is reported beside it)."""
    shares = time_shares_first_order(tau, c, m, **kw)
    shares.pop("goodput")
    return shares


def make_plan(
    failure: FailureModel,
    *,
    days: float = 30.0,
    ckpt_cost_s: float = 30.0,
    durable_s: float | None = None,
    async_ckpt_cost_s: float | None = None,
    restart_s: float = 300.0,
    interval_s: float | None = None,
    stall_frac: float = 0.0,
    simulate_runs: int = 2000,
    seed: int = 0,
    failure_shape: float = 1.0,
    restart_exposed_s: float | None = None,
) -> dict[str, Any]:
    """Everything ``steadytrain plan`` reports, as a JSON-ready dict (times in minutes/s).

    ``restart_exposed_s``: the part of ``restart_s`` failures can hit (None: all of it);
    only the exact goodput and the simulation tell the two apart (``interval.goodput_exact``).
    """
    m = failure.mtbf_s
    mode, modes = save_modes(ckpt_cost_s, durable_s, async_ckpt_cost_s)
    costs = modes[mode]
    c, l_s = costs["ckpt_cost_s"], costs["durable_s"]
    kw = {"restart_s": restart_s, "durable_s": l_s, "stall_frac": stall_frac}
    u = {"restart_exposed_s": restart_exposed_s}
    for info in modes.values():
        best = optimal_interval_s(info["ckpt_cost_s"], m, restart_s, info["durable_s"])
        info["optimal_interval_min"] = _minutes(best)
        args = (info["ckpt_cost_s"], m, restart_s, info["durable_s"], stall_frac)
        info["goodput_at_optimal"] = goodput_first_order(best, *args)
        info["goodput_exact_at_optimal"] = goodput_exact(best, *args, **u)

    best = optimal_interval_s(c, m, restart_s, l_s)
    tau = interval_s if interval_s is not None else best
    out: dict[str, Any] = {
        "failure_model": failure.source,
        "days": days,
        "p_failure": failure.p_failure(days),
        "interruptions_per_day": failure.interruptions_per_day,
        "expected_interruptions": failure.expected_interruptions(days),
        "mtbf_hours": failure.mtbf_hours,
        "mode": mode,
        "ckpt_cost_s": c,
        "durable_s": l_s,
        "restart_cost_s": restart_s,
        "restart_exposed_s": restart_s if restart_exposed_s is None else restart_exposed_s,
        "data_stall_frac": stall_frac,
        "young_interval_min": young_interval_s(c, m) / 60.0,
        "daly_interval_min": daly_interval_s(c, m) / 60.0,
        "exact_interval_min": exact_interval_s(c, m) / 60.0,
        "optimal_interval_min": _minutes(best),
        "interval_min": _minutes(tau),
        "interval_source": "given" if interval_s is not None else "optimal",
        "goodput": goodput_first_order(tau, c, m, **kw),
        "goodput_exact": goodput_exact(tau, c, m, **kw, **u),
        "goodput_at_optimal": goodput_first_order(best, c, m, **kw),
        "badput": _badput(tau, c, m, kw),
        "modes": modes,
    }
    minutes = set(TABLE_MINUTES)
    minutes.update(
        round(v, 2)
        for v in (out["interval_min"], *(i["optimal_interval_min"] for i in modes.values()))
        if v is not None and v > 0
    )
    rows = []
    for mins in sorted(minutes):
        for name, info in modes.items():
            args = (mins * 60.0, info["ckpt_cost_s"], m, restart_s, info["durable_s"], stall_frac)
            rows.append(
                {
                    "interval_min": mins,
                    "mode": name,
                    "goodput": goodput_first_order(*args),
                    "goodput_exact": goodput_exact(*args, **u),
                }
            )
    out["table"] = rows
    out["notes"] = []
    if tau == 0.0:
        out["notes"].append(
            "saves cost nothing here (C = L = 0): checkpoint as often as the checkpointer "
            "allows; goodput is the limit for ever shorter intervals (not simulated)"
        )
    if simulate_runs and tau > 0 and not math.isinf(tau):
        from steadytrain.planning.montecarlo import simulate  # numpy: only when simulating

        sim = simulate(
            tau, c, m, restart_s, l_s, stall_frac, days=days, runs=simulate_runs,
            seed=seed, failure_shape=failure_shape, restart_exposed_s=restart_exposed_s,
        )  # fmt: skip
        out["simulation"] = sim.to_dict()
    return out
