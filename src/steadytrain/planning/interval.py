"""Best checkpoint interval and the goodput it buys (closed forms).

Notation (seconds): ``tau`` the interval, i.e. the wall time the loop computes between the
end of one blocking save and the start of the next; ``C`` the part of a save the loop waits
for (``block_s``); ``L`` the time from the start of a save until it is durable
(``durable_s``, at least ``C``; ``L = C`` for a synchronous save); ``R`` the cost of one
restart (failure detection, rescheduling, startup, restore); ``M`` the mean time between
failures; ``s`` the share of compute-phase wall time the loop waits for data.

Two goodput models, both derived in docs/planning.md:

* first order (Young 1974): each failure wastes ``R`` plus the work since the last durable
  checkpoint, on average ``P/2 + L - C`` with ``P = tau + C`` (half an interval, plus the
  time an asynchronous save needs to land)::

      G1 = tau (1 - s) / P * (1 - (R + P/2 + L - C) / M)

  With ``C = R = L = s = 0`` this is ``1 - tau / (2 M)``: 8.6 interruptions a day and a
  checkpoint every 2 h give 1 - 8.6 * 1 h / 24 h = 64 %, every 30 min 91 % (Llama 3).
* exact for Poisson failures (the renewal argument of Daly 2006, extended to asynchronous
  saves)::

      G = tau (1 - s) * exp(-(R + tau + L) / M) / (M * (1 - exp(-(tau + C) / M)))

  which is Daly's ``tau / (M e^{R/M} (e^{(tau+C)/M} - 1))`` when ``L = C``. ``G1`` is its
  first-order expansion and a lower bound on it; the two part when ``tau`` nears ``M``.

Where failures can hit only part ``U`` of a restart (the rest, ``D = R - U``, is dead
time: the job is down and a failure has nothing to interrupt), a gap between failures is
``D`` plus an exposed time with mean ``M``, and ``exp(-(R + tau + L) / M) / M`` becomes
``exp(-(U + tau + L) / M) / (D + M)``; ``U = R`` (the default) is the form above.

``R`` and ``L`` scale the exact goodput by ``exp(-(R + L)/M)`` and so do not move its
maximum; only ``C`` and ``M`` do, and an asynchronous save adds the constraint ``tau >= L``
(at most one save in flight, so the previous checkpoint is always durable).
"""

from __future__ import annotations

import math

from steadytrain.errors import ConfigError

__all__ = [
    "young_interval_s",
    "daly_interval_s",
    "exact_interval_s",
    "optimal_interval_s",
    "goodput_first_order",
    "goodput_exact",
    "time_shares_first_order",
]


def _num(name: str, value: object, unit: str = "seconds") -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a number of {unit}") from None
    if math.isnan(v):
        raise ConfigError(f"{name}={value!r} must be a number of {unit}")
    return v


def _check(ckpt_cost_s: float, mtbf_s: float, restart_s: float = 0.0, durable_s: float = 0.0):
    for name, v in (
        ("ckpt_cost_s", ckpt_cost_s),
        ("restart_s", restart_s),
        ("durable_s", durable_s),
    ):
        x = _num(name, v)
        if not (math.isfinite(x) and x >= 0):
            raise ConfigError(f"{name}={v!r} must be a finite number of seconds >= 0")
    if not _num("mtbf_s", mtbf_s) > 0:
        raise ConfigError(f"mtbf_s={mtbf_s!r} must be a positive number of seconds")


def young_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``."""
    _check(ckpt_cost_s, mtbf_s)
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


def daly_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order estimate; ``M`` once ``C >= 2 M``."""
    _check(ckpt_cost_s, mtbf_s)
    c, m = float(ckpt_cost_s), float(mtbf_s)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def exact_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """The ``tau`` that maximises the exact goodput: the root of ``tau/M = 1 - e^{-(tau+C)/M}``.

    (``tau = M (1 + W0(-e^{-C/M - 1}))`` with Lambert's W; solved by bisection on (0, M)
    so no special functions are needed.) Daly's formula approximates this root.
    """
    _check(ckpt_cost_s, mtbf_s)
    if math.isinf(mtbf_s):
        return math.inf
    c = ckpt_cost_s / mtbf_s
    if c == 0.0:
        return 0.0
    lo, hi = 0.0, 1.0  # g(lo) < 0 < g(hi) for g(u) = u - (1 - e^{-(u + c)})
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid + math.expm1(-(mid + c)) < 0.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return 0.5 * (lo + hi) * mtbf_s


def optimal_interval_s(
    ckpt_cost_s: float, mtbf_s: float, restart_s: float = 0.0, durable_s: float = 0.0
) -> float:
    """The checkpoint interval (seconds of compute between saves) that maximises goodput.

    ``ckpt_cost_s``: seconds a save blocks the loop; ``mtbf_s``: the job's mean time
    between failures; ``restart_s``: cost of one restart; ``durable_s``: seconds from the
    start of a save until it is durable (asynchronous saves). The exact optimum of the
    Poisson model, raised to ``durable_s`` so that at most one save is in flight. The
    restart cost lowers goodput but does not move the optimum (as in Daly's model); it is checked
    and accepted so callers can pass everything they measured. ``inf`` when ``mtbf_s`` is
    infinite (no failures: no reason to checkpoint for them); 0 when saves are free.
    """
    _check(ckpt_cost_s, mtbf_s, restart_s, durable_s)
    return max(exact_interval_s(float(ckpt_cost_s), float(mtbf_s)), float(durable_s))


def _terms(tau: float, c: float, l_s: float, w: float) -> tuple[float, float, float]:
    """Effective (block, durable) when the interval is shorter than a save takes to land.

    A checkpointer does not start a save while the previous one is in flight, so the loop
    waits: the blocking part per period becomes ``max(C, L - tau)``.
    """
    if tau < 0 or not math.isfinite(tau):
        raise ConfigError(f"interval {tau!r} s must be a finite number >= 0")
    if not (0.0 <= w < 1.0):
        raise ConfigError(f"data stall share {w!r} must be in [0, 1): waiting time / step time")
    l_eff = max(l_s, c)
    return max(c, l_eff - tau), l_eff, 1.0 - w


def goodput_first_order(
    interval_s: float,
    ckpt_cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    durable_s: float = 0.0,
    stall_frac: float = 0.0,
) -> float:
    """Young's first-order goodput (share of wall time that is kept compute), floored at 0:
    the ``goodput`` share of ``time_shares_first_order`` (one model, not two to drift)."""
    return time_shares_first_order(
        interval_s, ckpt_cost_s, mtbf_s, restart_s, durable_s, stall_frac
    )["goodput"]


def time_shares_first_order(
    interval_s: float,
    ckpt_cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    durable_s: float = 0.0,
    stall_frac: float = 0.0,
) -> dict[str, float]:
    """Where the wall time goes under the first-order model, in the report's bucket names.

    Shares of wall time that sum to 1; ``goodput`` equals ``goodput_first_order``. With
    ``r = R/M`` and ``w = (P/2 + L - C)/M`` (the share lost to restarts and to redone work)::

        restart          = r                      (report: startup + restore + restart_gap)
        checkpoint_block = (1 - r) C / P
        data_wait        = (1 - r) tau s / P      (redone steps wait too, as in the ledger)
        lost_to_failures = w tau (1 - s) / P      (productive time of redone steps)
        goodput          = (1 - r - w) tau (1 - s) / P

    ``r`` and ``w`` are capped so that no share is negative (where ``goodput_first_order``
    floors at 0).
    """
    _check(ckpt_cost_s, mtbf_s, restart_s, durable_s)
    c, l_eff, keep = _terms(interval_s, ckpt_cost_s, durable_s, stall_frac)
    period = interval_s + c
    lam = 1.0 / mtbf_s
    r = min(1.0, lam * restart_s)
    if period == 0.0:  # free saves, taken continuously: the tau -> 0 limit
        train, w = 1.0, 0.0
    else:
        train = interval_s / period
        w = min(1.0 - r, lam * (period / 2.0 + l_eff - c))
    return {
        "goodput": (1.0 - r - w) * train * keep,
        "data_wait": (1.0 - r) * train * (1.0 - keep),
        "checkpoint_block": (1.0 - r) * (1.0 - train),
        "restart": r,
        "lost_to_failures": w * train * keep,
    }


def goodput_exact(
    interval_s: float,
    ckpt_cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    durable_s: float = 0.0,
    stall_frac: float = 0.0,
    restart_exposed_s: float | None = None,
) -> float:
    """Long-run goodput with Poisson failures (failures may also hit saves).

    ``restart_exposed_s`` (``U``, at most ``restart_s``): the part of a restart that
    failures can hit; ``None`` means all of it (a cluster, where hardware fails whenever it
    likes: Daly's model). The rest, ``D = R - U``, is dead time no failure can interrupt
    (the job is already down: detection, rescheduling, a process that has not yet joined),
    and ``mtbf_s`` is then the mean time between failures of the time a job is up (the
    rate ``measure_run`` observes). With ``U = R`` this is the classic form.
    """
    _check(ckpt_cost_s, mtbf_s, restart_s, durable_s)
    exposed = _exposed(restart_s, restart_exposed_s)
    dead = restart_s - exposed
    c, l_eff, keep = _terms(interval_s, ckpt_cost_s, durable_s, stall_frac)
    period = interval_s + c
    if math.isinf(mtbf_s):
        return interval_s / period * keep if period > 0 else keep
    lam = 1.0 / mtbf_s
    if period == 0.0:  # free saves, taken continuously: the tau -> 0 limit
        return keep * math.exp(-lam * exposed) / (1.0 + lam * dead)
    # E[checkpoints secured between two failures] * tau / (D + M); see module docstring.
    secured = math.exp(-lam * (exposed + interval_s + l_eff)) / -math.expm1(-lam * period)
    return interval_s * keep * lam * secured / (1.0 + lam * dead)


def _exposed(restart_s: float, restart_exposed_s: float | None) -> float:
    """``U``: the part of the restart failures can hit (all of it when not given)."""
    if restart_exposed_s is None:
        return float(restart_s)
    u = _num("restart_exposed_s", restart_exposed_s)
    if not 0.0 <= u <= restart_s * (1 + 1e-12):
        raise ConfigError(
            f"restart_exposed_s={restart_exposed_s!r} must be between 0 and restart_s="
            f"{restart_s!r}: it is the part of a restart that failures can hit"
        )
    return min(u, float(restart_s))
