"""Failure model: how often a job of N GPUs is interrupted.

Failures of the whole job form a Poisson process of rate ``lambda`` per hour of wall time
(the exponential model): with a per-GPU annual failure rate ``afr`` (failures per GPU-year,
as a rate, not a probability) a job on ``N`` GPUs sees ``lambda = N * afr / 8760`` failures
an hour, its mean time between failures is ``1 / lambda`` and the probability that a run of
``D`` days sees at least one failure is ``1 - exp(-lambda * 24 * D)``.

Reference points (docs/planning.md): 1 %/GPU-year gives 19 % for 256 GPUs over 30 days and
57 % for 1,024 GPUs; Llama 3 saw 466 interruptions in 54 days on 16,384 GPUs (8.6 a day).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from steadytrain.errors import ConfigError

__all__ = ["FailureModel", "LLAMA3_AFR", "LLAMA3_INTERRUPTIONS_PER_DAY"]

HOURS_PER_YEAR = 365.0 * 24.0

# Llama 3 (Grattafiori et al. 2024, sec. 3.3.4): 466 job interruptions (419 unexpected, 47
# planned) in a 54-day snapshot on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS_PER_DAY = 466 / 54
# The same rate per GPU-year, all causes: the default when no failure rate is given.
LLAMA3_AFR = LLAMA3_INTERRUPTIONS_PER_DAY * 365.0 / 16384


def _positive(name: str, value: float, fix: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive number; {fix}")
    return v


@dataclass(frozen=True)
class FailureModel:
    """Job-level failure rate; build it with one of the ``from_*`` constructors."""

    rate_per_hour: float
    source: str = ""

    @classmethod
    def from_afr(cls, gpus: int, afr: float) -> FailureModel:
        """``afr`` failures per GPU per year (0.01 = 1 %), ``gpus`` GPUs in the job."""
        g = _positive("gpus", gpus, "give the number of GPUs in the job (--gpus)")
        a = _positive("afr", afr, "give failures per GPU per year, e.g. 0.01 for 1 %")
        return cls(g * a / HOURS_PER_YEAR, f"afr={a:g}/GPU-year x {int(g)} GPUs")

    @classmethod
    def from_mtbf_hours(cls, mtbf_hours: float) -> FailureModel:
        """Mean time between failures of the whole job (all its GPUs together)."""
        m = _positive("mtbf_hours", mtbf_hours, "give the job's mean time between failures")
        return cls(1.0 / m, f"mtbf={m:g} h")

    @classmethod
    def from_interruptions_per_day(cls, per_day: float) -> FailureModel:
        """Observed interruptions per day of wall time (Llama 3: 8.6 on 16k GPUs)."""
        x = _positive("interruptions_per_day", per_day, "give interruptions per day, e.g. 8.6")
        return cls(x / 24.0, f"{x:g} interruptions/day")

    @property
    def mtbf_hours(self) -> float:
        return 1.0 / self.rate_per_hour

    @property
    def mtbf_s(self) -> float:
        return 3600.0 / self.rate_per_hour

    @property
    def interruptions_per_day(self) -> float:
        return self.rate_per_hour * 24.0

    def expected_interruptions(self, days: float) -> float:
        return self.rate_per_hour * 24.0 * days

    def p_failure(self, days: float) -> float:
        """Probability of at least one failure in ``days`` days of wall time."""
        return -math.expm1(-self.expected_interruptions(days))
