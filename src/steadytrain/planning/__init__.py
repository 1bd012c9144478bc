"""Goodput planning: failure model, best checkpoint interval, Monte-Carlo check.

See docs/planning.md for the model. This package is the one import path for the planner;
the checkpointer's ``interval="auto"`` calls ``optimal_interval_s``; ``steadytrain plan`` and
``steadytrain demo`` both call ``plan_from_run``; ``two_tier`` adds the memory tier (a
snapshot interval in steps beside the durable one; ``plan --two-tier``). A run's ledger is
read through ``steadytrain.monitor`` (``measure_run``). The Monte-Carlo simulator (numpy)
is imported only when asked for.
"""

from typing import TYPE_CHECKING, Any

from steadytrain.planning.failures import LLAMA3_AFR, LLAMA3_INTERRUPTIONS_PER_DAY, FailureModel
from steadytrain.planning.from_run import plan_from_run
from steadytrain.planning.interval import (
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    optimal_interval_s,
    time_shares_first_order,
    young_interval_s,
)
from steadytrain.planning.run_costs import RunCosts, measure_run
from steadytrain.planning.summary import make_plan
from steadytrain.planning.two_tier import TierCosts, goodput_two_tier

if TYPE_CHECKING:
    from steadytrain.planning.montecarlo import SimResult, simulate

__all__ = [
    "FailureModel",
    "LLAMA3_AFR",
    "LLAMA3_INTERRUPTIONS_PER_DAY",
    "RunCosts",
    "SimResult",
    "TierCosts",
    "daly_interval_s",
    "exact_interval_s",
    "goodput_exact",
    "goodput_first_order",
    "goodput_two_tier",
    "make_plan",
    "measure_run",
    "optimal_interval_s",
    "plan_from_run",
    "simulate",
    "time_shares_first_order",
    "young_interval_s",
]


def __getattr__(name: str) -> Any:
    if name in ("SimResult", "simulate"):
        import importlib

        return getattr(importlib.import_module("steadytrain.planning.montecarlo"), name)
    raise AttributeError(f"module 'steadytrain.planning' has no attribute {name!r}")
