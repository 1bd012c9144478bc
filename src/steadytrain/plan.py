"""Goodput planner: the stable import path (``steadytrain.plan.optimal_interval_s``).

The implementation lives in ``steadytrain.planning`` (failures, interval, simulate, ledger,
summary); this module re-exports it. The checkpointer's ``interval="auto"`` calls
``optimal_interval_s(ckpt_cost_s, mtbf_s, restart_s=0.0, durable_s=0.0) -> float``.
"""

from typing import TYPE_CHECKING

from steadytrain.planning import (
    LLAMA3_AFR,
    LLAMA3_INTERRUPTIONS_PER_DAY,
    FailureModel,
    RunCosts,
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    make_plan,
    measure_run,
    optimal_interval_s,
    young_interval_s,
)

if TYPE_CHECKING:
    from steadytrain.planning.simulate import SimResult, simulate

__all__ = [
    "FailureModel",
    "LLAMA3_AFR",
    "LLAMA3_INTERRUPTIONS_PER_DAY",
    "RunCosts",
    "SimResult",
    "daly_interval_s",
    "exact_interval_s",
    "goodput_exact",
    "goodput_first_order",
    "make_plan",
    "measure_run",
    "optimal_interval_s",
    "simulate",
    "young_interval_s",
]


def __getattr__(name: str):
    # The simulator needs numpy; keep ``import steadytrain.plan`` (the checkpointer's
    # auto interval) free of it until someone simulates.
    if name in ("SimResult", "simulate"):
        from steadytrain.planning import simulate as _sim

        return getattr(_sim, name)
    raise AttributeError(f"module 'steadytrain.plan' has no attribute {name!r}")
