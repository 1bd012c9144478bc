"""Monte-Carlo simulation of a training run under failures (vectorised numpy, seeded).

The run alternates compute phases and saves: a compute phase does ``tau (1 - s)`` seconds of
useful work (``s`` the data stall share) and, because the loop waits for data, takes
``tau (1 - s) (1 + z)`` seconds of wall time, with ``z`` random (Gamma, mean ``s / (1 - s)``,
coefficient of variation ``stall_cv``), so ``tau`` on average; the save then blocks ``C`` and becomes durable ``L`` after it started.
Failures end a *cycle*: the times between failures are drawn i.i.d. (exponential with mean
``M``, or Weibull with shape ``failure_shape`` and the same mean, to see what bursty failures
do). Each cycle starts with a restart of ``R`` seconds (a failure inside it restarts again)
and keeps the work of the checkpoints that became durable before the failure.

Everything is vectorised over (run, cycle). The number of checkpoints a cycle secures is a
first-passage count of a random walk; with random stalls it is found by bisection on the
Gamma process of stall time (Gamma bridges are Beta-distributed), about log2(#saves) numpy
steps for all cycles at once. Two estimates come back: per-run goodput over the horizon
(``days`` of wall time; its spread is the distribution) and the long-run goodput pooled over
a fixed number of cycles per run (a ratio estimator without horizon bias) with its standard
error and 95 % confidence interval; a closed form "agrees" when it lies within the 99.9 %
interval (``AGREE_Z`` standard errors).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from steadytrain.errors import ConfigError
from steadytrain.planning.interval import _exposed, _terms, goodput_exact, goodput_first_order

__all__ = ["SimResult", "simulate"]

MAX_CELLS = 3_000_000  # runs x cycles kept in memory at once (~24 MB per float array)
AGREE_Z = 3.29  # "agrees": inside the 99.9 % confidence interval (two-sided)


@dataclass
class SimResult:
    runs: int
    days: float
    seed: int
    cycles_per_run: int
    mean: float  # long-run goodput, pooled over all simulated cycles
    stderr: float
    ci95: tuple[float, float]
    horizon_mean: float  # mean of the per-run goodputs over ``days``
    p5: float
    p50: float
    p95: float
    min: float
    interruptions_mean: float  # per run, over ``days``
    closed_form_exact: float
    closed_form_first_order: float
    exact_agrees: bool  # closed form within AGREE_Z standard errors of ``mean``
    first_order_agrees: bool
    exact_applies: bool  # the assumptions of the exact closed form hold for these inputs

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def _secured(y, seg_work, c, stall_mean, stall_cv, rng):
    """Checkpoints whose save ends (shifted by L - C) before ``y``: max k, S_k <= y.

    ``S_k = k (seg_work + c) + seg_work * stall_mean * Gamma_k`` with ``Gamma_k`` a Gamma
    process (shape ``k / cv^2``, scale ``cv^2``, so each step has mean 1).
    """
    step = seg_work + c
    kmax = np.floor(np.maximum(y, -1.0) / step).astype(np.int64)  # stalls only add time
    kmax = np.maximum(kmax, -1)
    if stall_mean == 0.0 or stall_cv == 0.0:
        n = kmax if stall_mean == 0.0 else np.floor(y / (step + seg_work * stall_mean))
        return np.maximum(np.asarray(n, dtype=np.int64), 0)
    alpha, theta = 1.0 / stall_cv**2, stall_cv**2
    scale = seg_work * stall_mean
    lo = np.zeros_like(kmax)
    g_lo = np.zeros(kmax.shape)
    hi = np.maximum(kmax + 1, 1)
    g_hi = rng.gamma(hi * alpha, theta)
    active = hi - lo > 1
    while active.any():
        idx = np.nonzero(active)[0]
        a_lo, a_hi = lo[idx], hi[idx]
        mid = (a_lo + a_hi) // 2
        frac = rng.beta((mid - a_lo) * alpha, (a_hi - mid) * alpha)
        g_mid = g_lo[idx] + (g_hi[idx] - g_lo[idx]) * frac
        ok = mid * step + scale * g_mid <= y[idx]
        lo[idx] = np.where(ok, mid, a_lo)
        g_lo[idx] = np.where(ok, g_mid, g_lo[idx])
        hi[idx] = np.where(ok, a_hi, mid)
        g_hi[idx] = np.where(ok, g_hi[idx], g_mid)
        active = hi - lo > 1
    # lo is the largest k known to fit; k = kmax + 1 never fits, k = 0 always does.
    return np.where(kmax >= 1, lo, 0)


def simulate(
    interval_s: float,
    ckpt_cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    durable_s: float = 0.0,
    stall_frac: float = 0.0,
    stall_cv: float = 1.0,
    days: float = 30.0,
    runs: int = 2000,
    seed: int = 0,
    failure_shape: float = 1.0,
    restart_exposed_s: float | None = None,
) -> SimResult:
    """Simulate ``runs`` runs of ``days`` days; see the module docstring for the model.

    ``restart_exposed_s``: the part ``U`` of each restart that failures can hit (default:
    all of it); the rest is dead time added to each gap between failures, which are then
    drawn over the time the job is up (``interval.goodput_exact``)."""
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise ConfigError(f"interval {interval_s!r} s must be > 0 to simulate")
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ConfigError(f"mtbf {mtbf_s!r} s must be positive and finite to simulate")
    if not (days > 0 and runs >= 2 and failure_shape > 0 and stall_cv >= 0):
        raise ConfigError(
            f"simulation needs days > 0 (got {days}), runs >= 2 (got {runs}), "
            f"failure_shape > 0 (got {failure_shape}) and stall_cv >= 0 (got {stall_cv})"
        )
    c, l_eff, keep = _terms(interval_s, ckpt_cost_s, durable_s, stall_frac)
    exposed = _exposed(restart_s, restart_exposed_s)
    dead = restart_s - exposed  # wall time of a restart that no failure can hit
    seg_work = interval_s * keep  # useful seconds per compute phase
    horizon = days * 86400.0
    rng = np.random.default_rng(seed)

    n_fail = horizon / mtbf_s
    cv2 = math.gamma(1 + 2 / failure_shape) / math.gamma(1 + 1 / failure_shape) ** 2 - 1
    cycles = int(math.ceil(n_fail + 6.0 * math.sqrt(max(n_fail, 1.0) * max(cv2, 1.0)) + 8))
    runs = int(min(runs, max(2, MAX_CELLS // cycles)))

    def draw(shape):
        if failure_shape == 1.0:
            return rng.exponential(mtbf_s, shape)
        return mtbf_s / math.gamma(1 + 1 / failure_shape) * rng.weibull(failure_shape, shape)

    x = draw((runs, cycles))  # exposed time of each gap; its wall time is dead + x
    ends = np.cumsum(x + dead, axis=1)
    while (short := ends[:, -1] < horizon).any():  # rare: extend every run equally
        more = draw((runs, cycles // 2 + 1))
        x = np.concatenate([x, more], axis=1)
        ends = np.cumsum(x + dead, axis=1)
        if x.size > 4 * MAX_CELLS:
            raise ConfigError(f"{int(short.sum())} simulated runs need too many cycles")

    z_mean = stall_frac / (1.0 - stall_frac)  # stall seconds per useful second

    def work(window):
        y = window - exposed + c - l_eff
        return _secured(y, seg_work, c, z_mean, stall_cv, rng) * seg_work

    def work_at_end(window):
        # The run ends as planned at the horizon and saves: every finished compute phase
        # counts, and so does the part of the one under way (at its mean pace).
        w = np.maximum(window - dead, 0.0) - exposed
        n = _secured(w + c, seg_work, c, z_mean, stall_cv, rng)
        rest = (w - n * (seg_work * (1 + z_mean) + c)) / (1 + z_mean)
        return n * seg_work + np.clip(rest, 0.0, seg_work)

    done = work(x.ravel()).reshape(x.shape)  # useful seconds kept by each cycle

    # Long-run: pooled ratio over all cycles of all runs, CI by the delta method over runs.
    a, b = done.sum(axis=1), (x + dead).sum(axis=1)
    g = float(a.sum() / b.sum())
    se = float(np.sqrt(((a - g * b) ** 2).sum() / (runs * (runs - 1))) / b.mean())
    ci = (g - 1.96 * se, g + 1.96 * se)

    # Horizon: cycles that ended before it count whole, the one it cuts counts to it.
    j = np.argmax(ends >= horizon, axis=1)
    rows = np.arange(runs)
    before = np.where(np.arange(x.shape[1])[None, :] < j[:, None], done, 0.0).sum(axis=1)
    started = np.where(j > 0, ends[rows, j - 1], 0.0)
    last = work_at_end(horizon - started)
    per_run = (before + last) / horizon

    exact = goodput_exact(
        interval_s, ckpt_cost_s, mtbf_s, restart_s, durable_s, stall_frac, exposed
    )
    first = goodput_first_order(interval_s, ckpt_cost_s, mtbf_s, restart_s, durable_s, stall_frac)
    applies = failure_shape == 1.0 and (stall_frac == 0.0 or stall_cv == 0.0)
    q = np.quantile(per_run, [0.05, 0.5, 0.95])
    return SimResult(
        runs=runs,
        days=float(days),
        seed=int(seed),
        cycles_per_run=int(x.shape[1]),
        mean=g,
        stderr=se,
        ci95=(float(ci[0]), float(ci[1])),
        horizon_mean=float(per_run.mean()),
        p5=float(q[0]),
        p50=float(q[1]),
        p95=float(q[2]),
        min=float(per_run.min()),
        interruptions_mean=float(j.mean()),
        closed_form_exact=exact,
        closed_form_first_order=first,
        exact_agrees=bool(abs(exact - g) <= AGREE_Z * se),
        first_order_agrees=bool(abs(first - g) <= AGREE_Z * se),
        exact_applies=applies,
    )
