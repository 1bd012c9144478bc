"""Goodput planning: failure model, best checkpoint interval, Monte-Carlo check.

See docs/planning.md for the model. This package is the one import path for the planner;
the checkpointer's ``interval="auto"`` calls ``optimal_interval_s``. The Monte-Carlo
simulator (numpy) is imported only when asked for.
"""

from typing import TYPE_CHECKING, Any

from steadytrain.planning.failures import LLAMA3_AFR, LLAMA3_INTERRUPTIONS_PER_DAY, FailureModel
from steadytrain.planning.interval import (
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    optimal_interval_s,
    young_interval_s,
)
from steadytrain.planning.run_costs import RunCosts, measure_run
from steadytrain.planning.summary import make_plan

if TYPE_CHECKING:
    from steadytrain.planning.montecarlo import SimResult, simulate

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


def __getattr__(name: str) -> Any:
    if name in ("SimResult", "simulate"):
        import importlib

        return getattr(importlib.import_module("steadytrain.planning.montecarlo"), name)
    raise AttributeError(f"module 'steadytrain.planning' has no attribute {name!r}")
