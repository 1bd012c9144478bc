"""Goodput planning: failure model, best checkpoint interval, Monte-Carlo check.

See docs/planning.md for the model. ``steadytrain.plan`` re-exports the public names.
"""

from steadytrain.planning.failures import LLAMA3_AFR, LLAMA3_INTERRUPTIONS_PER_DAY, FailureModel
from steadytrain.planning.interval import (
    daly_interval_s,
    exact_interval_s,
    goodput_exact,
    goodput_first_order,
    optimal_interval_s,
    young_interval_s,
)
from steadytrain.planning.ledger import RunCosts, measure_run
from steadytrain.planning.summary import make_plan

__all__ = [
    "FailureModel",
    "LLAMA3_AFR",
    "LLAMA3_INTERRUPTIONS_PER_DAY",
    "RunCosts",
    "daly_interval_s",
    "exact_interval_s",
    "goodput_exact",
    "goodput_first_order",
    "make_plan",
    "measure_run",
    "optimal_interval_s",
    "young_interval_s",
]
