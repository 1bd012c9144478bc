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

__all__ = ["FailureModel", "LLAMA3_AFR", "LLAMA3_INTERRUPTIONS_PER_DAY", "rate_interval"]

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


def _gamma_p(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) (series below a + 1, else a continued
    fraction; Numerical Recipes 6.2), to ~1e-12."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return total * math.exp(log_front)
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return 1.0 - math.exp(log_front) * h


def _gamma_ppf(q: float, a: float) -> float:
    """The ``q`` quantile of Gamma(shape ``a``, scale 1), by bisection on ``_gamma_p``."""
    lo, hi = 0.0, max(1.0, a)
    while _gamma_p(a, hi) < q:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _gamma_p(a, mid) < q else (lo, mid)
    return (lo + hi) / 2


def rate_interval(events: int, exposure: float, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Garwood) confidence interval of a Poisson rate seen as ``events`` failures
    in ``exposure`` time: ``[Gamma(k).ppf(a/2), Gamma(k + 1).ppf(1 - a/2)] / exposure``,
    ``a = 1 - confidence``, in events per unit of ``exposure``. With few failures it is
    wide (3 failures: 0.21x to 2.9x the observed rate): a run's own rate is an estimate,
    and the plan says how far it may be off (issue 13)."""
    if events < 0 or not exposure > 0 or not 0 < confidence < 1:
        raise ConfigError(
            f"rate_interval({events}, {exposure}, {confidence}): give events >= 0, a "
            "positive exposure and a confidence between 0 and 1"
        )
    alpha = 1.0 - confidence
    lo = _gamma_ppf(alpha / 2, events) if events > 0 else 0.0
    return lo / exposure, _gamma_ppf(1 - alpha / 2, events + 1) / exposure
