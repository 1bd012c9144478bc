"""Two tiers of recovery points: a memory tier every ``K_m`` steps, durable saves every ``tau_d``.

The memory tier (issue 28) keeps a snapshot of every rank's states in node-local memory and a
copy on a peer node. It survives a process crash (the node's memory is still there) and the
loss of one node (its peer holds its copy); it does not survive a node lost together with its
peer, or a changed world layout: those restart from durable storage. A share ``f`` of the
failures is of the first kind. The model is the first-order one of ``interval.py``
(docs/planning.md), with the failures split by the tier they restart from.

Notation (seconds): ``t`` one step's wall time without checkpoint blocking; ``c_m`` the
blocking of one snapshot, ``l_m`` from its start until the generation is usable (staging,
write, peer copy; ``>= c_m``), ``r_m`` a restore from memory; ``c_d``, ``L_d`` a durable
save's blocking and time to land, ``R`` a restart from durable storage (restore ``r_d``
included); a restart from memory costs ``R_m = R - r_d + r_m`` (the same detection,
rescheduling and start-up, a faster restore). ``lambda = 1/M`` the failure rate, ``s`` the
data stall share.

Per second of training the loop blocks ``a = c_m / (K_m t)`` for snapshots; a durable period
is ``P_d = tau_d (1 + a) + c_d``; a snapshot period ``P_m = K_m t + c_m``. A failure restarts
from the newest usable point (a tie goes to memory, as ``restore_latest`` decides): a
memory-kind failure loses ``W_m = P_m/2 + l_m - c_m`` of work and costs ``R_m``, unless the
durable point is newer (``W_d <= W_m``); a durable-kind failure loses ``W_d = P_d/2 + L_d -
c_d`` and costs ``R``. So::

    G = (1 - s) * tau_d / P_d * (1 - lambda [f (R_m + W_m) + (1 - f) (R + W_d)])

With the tier off (``a = 0`` and every failure durable) this is ``goodput_first_order`` of
``interval.py`` exactly (a test checks it). At one snapshot in flight, a snapshot that has
not landed when the next is due blocks the loop: ``c_m`` becomes ``max(c_m, l_m - K_m t)``,
as ``_terms`` does for durable saves.

How the intervals are chosen (``recommend``): for a fixed ``K_m`` the durable interval has a
closed form -- with ``y = P_d``, ``G`` is proportional to ``(1 - c_d/y)(B - k y)`` (``k =
lambda (1 - f)/2``, ``B`` the rest), whose maximum is at ``y = sqrt(B c_d / k)``, so
``tau_d = (sqrt(B c_d / k) - c_d) / (1 + a)``, raised to ``L_d`` (one save in flight) and
infinite when ``f = 1`` (no failure needs durable storage; the run's end still does). That
holds while the snapshot is the newer point; past it every failure restarts from storage
(the same form with ``f = 0``), so ``best_durable_interval_s`` takes the better of the two
optima and the boundary between them (``G`` is unimodal on each piece). The
snapshot interval is an integer: every ``K_m`` from 1 to ``4 x`` the Young-like estimate
``sqrt(2 c_m / (lambda f)) / t`` is evaluated (a golden-section search over integers when that
range is long: the waste ``c_m/(K_m t) + lambda f K_m t/2`` is convex), and the tier off is a
candidate too: when it wins (``f = 0``, or snapshots dearer than what they save), the
recommendation says so and the two-tier goodput equals the durable-only one. Durable-only is
the same model with the tier off and its own closed-form interval (the first-order optimum;
``interval.optimal_interval_s`` maximises the exact model, which differs by a fraction of a
point at these rates), so the two numbers compared come from one model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from steadytrain.errors import ConfigError

__all__ = [
    "TierCosts",
    "best_durable_interval_s",
    "evaluate",
    "goodput_two_tier",
    "memory_every_steps",
    "recommend",
]

_SCAN = 4096  # K_m ranges up to this long are scanned whole; longer ones searched


@dataclass(frozen=True)
class TierCosts:
    """The costs of both tiers (seconds) and the share of failures memory survives."""

    step_s: float  # t
    memory_cost_s: float  # c_m
    memory_restore_s: float  # r_m
    durable_cost_s: float  # c_d
    restart_s: float  # R: a restart from durable storage, its restore included
    durable_restore_s: float  # r_d (part of R)
    survives: float  # f
    memory_landed_s: float | None = None  # l_m (None: = c_m)
    durable_s: float | None = None  # L_d (None: = c_d)
    stall_frac: float = 0.0  # s
    # q: the share of all failures recovered in place (survivors keep their processes and
    # roll back from memory; issue 44), each costing in_place_s instead of R_m. A subset of
    # the failures memory survives: q <= f.
    in_place_share: float = 0.0
    in_place_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("memory_cost_s", "memory_restore_s", "durable_cost_s", "restart_s",
                     "durable_restore_s", "memory_landed_s", "durable_s", "in_place_s"):  # fmt: skip
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 <= v < math.inf):
                raise ConfigError(f"{name}={v!r} must be a finite number of seconds >= 0")
        if not (isinstance(self.step_s, (int, float)) and 0 < self.step_s < math.inf):
            raise ConfigError(f"step_s={self.step_s!r} must be a positive number of seconds")
        if not 0.0 <= self.survives <= 1.0:
            raise ConfigError(
                f"survives={self.survives!r} must be a share between 0 and 1: the failures "
                "the memory tier survives (process crashes, one node lost)"
            )
        if not 0.0 <= self.stall_frac < 1.0:
            raise ConfigError(f"stall_frac={self.stall_frac!r} must be in [0, 1)")
        if not 0.0 <= self.in_place_share <= self.survives:
            raise ConfigError(
                f"in_place_share={self.in_place_share!r} must be between 0 and survives="
                f"{self.survives!r}: a recovery in place rolls back from the memory tier, so "
                "only failures memory survives can take it (--in-place-share <= "
                "--memory-survives)"
            )

    @property
    def whole_memory_restart_s(self) -> float:
        """A whole restart from memory: ``R - r_d + r_m`` (``r_d`` capped at ``R``)."""
        return self.restart_s - min(self.durable_restore_s, self.restart_s) + self.memory_restore_s

    @property
    def memory_restart_s(self) -> float:
        """``R_m``: the mean restart of a failure memory survives -- in place for ``q/f`` of
        them, a whole restart from memory for the rest (``R - r_d + r_m`` when ``q = 0``)."""
        whole = self.whole_memory_restart_s
        if self.in_place_share <= 0.0:
            return whole
        q = self.in_place_share / self.survives
        return q * self.in_place_s + (1.0 - q) * whole

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory_restart_s": self.memory_restart_s}


def _memory(k: int | None, c: TierCosts) -> tuple[float, float]:
    """(blocking per training second ``a``, work a memory restart loses ``W_m``)."""
    if k is None:
        return 0.0, math.inf
    period = k * c.step_s
    landed = max(c.memory_cost_s, c.memory_landed_s or 0.0)
    block = max(c.memory_cost_s, landed - period)  # one generation in flight
    return block / period, (period + block) / 2.0 + landed - block


def _split(k: int | None, c: TierCosts) -> float:
    return c.survives if k is not None else 0.0


def goodput_two_tier(
    memory_every_steps: int | None, durable_interval_s: float, costs: TierCosts, mtbf_s: float
) -> float:
    """First-order goodput with a snapshot every ``memory_every_steps`` steps (None: the
    memory tier off) and ``durable_interval_s`` seconds of training between durable saves
    (``inf``: none; only sensible when every failure is survived by memory)."""
    return evaluate(memory_every_steps, durable_interval_s, costs, mtbf_s)["goodput"]


def evaluate(k: int | None, tau: float, c: TierCosts, mtbf_s: float) -> dict[str, Any]:
    """The model at one pair of intervals: goodput and where the failures' time goes."""
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ConfigError(f"memory interval {k!r} must be a whole number of steps >= 1")
    if not tau >= 0:
        raise ConfigError(f"durable interval {tau!r} s must be >= 0")
    if not mtbf_s > 0:
        raise ConfigError(f"mtbf_s={mtbf_s!r} must be positive")
    lam = 0.0 if math.isinf(mtbf_s) else 1.0 / mtbf_s
    a, w_m = _memory(k, c)
    f = _split(k, c)
    l_d = max(c.durable_cost_s, c.durable_s or 0.0)
    if math.isinf(tau):
        train, w_d = 1.0 / (1.0 + a), math.inf
        snap = a / (1.0 + a)
    else:
        block = max(c.durable_cost_s, l_d - tau)
        period = tau * (1.0 + a) + block
        train = tau / period if period > 0 else 1.0 / (1.0 + a)
        snap = tau * a / period if period > 0 else a / (1.0 + a)
        w_d = _durable_age(tau, a, c, l_d)
    # The newest usable point wins (a tie: memory): a memory-kind failure whose snapshot is
    # older than the durable save restarts from durable storage.
    per_memory = c.memory_restart_s + w_m if w_m <= w_d else c.restart_s + w_d
    per_durable = c.restart_s + w_d if f < 1.0 else 0.0
    if math.isinf(per_durable) and lam > 0:
        loss = math.inf
    else:
        loss = lam * (f * per_memory + (1.0 - f) * per_durable) if lam > 0 else 0.0
    keep = 1.0 - c.stall_frac
    return {
        "goodput": max(0.0, keep * train * (1.0 - loss)),
        "lost_per_failure_s": f * min(w_m, w_d) + (1.0 - f) * w_d if f < 1.0 else min(w_m, w_d),
        "restart_per_failure_s": f * (c.memory_restart_s if w_m <= w_d else c.restart_s)
        + (1.0 - f) * c.restart_s,
        "blocking_share": 1.0 - train,
        # Where the time goes (planning/restart_plan.py splits the failures' part by phase):
        "snapshot_blocking_share": snap,
        "from_memory": w_m <= w_d,
        "failures_per_s": lam,
    }


def best_durable_interval_s(k: int | None, c: TierCosts, mtbf_s: float) -> float:
    """The ``tau_d`` that maximises ``goodput_two_tier`` for a given ``K_m``; ``inf`` when
    no failure needs durable storage.

    ``G`` is piecewise: while the snapshot is the newer point (``W_m <= W_d``) memory-kind
    failures restart from memory (the closed form of the module docstring); once durable
    saves come more often than that, every failure restarts from storage (the same form
    with ``f = 0``). Each piece is unimodal in ``tau_d``, so the best of the two optima, the
    boundary between the pieces and ``L_d`` (the least interval: one save in flight) is the
    maximum.
    """
    lam = 0.0 if math.isinf(mtbf_s) else 1.0 / mtbf_s
    f = _split(k, c)
    a, w_m = _memory(k, c)
    l_d = max(c.durable_cost_s, c.durable_s or 0.0)
    cands = {l_d}
    for share in {f, 0.0}:  # restarts from memory for a share f of failures, or none
        slope = lam * (1.0 - share) / 2.0
        if slope == 0.0:
            cands.add(math.inf)
            continue
        per_memory = share * (c.memory_restart_s + w_m) if share > 0 else 0.0  # 0 x inf
        b = 1.0 - lam * (per_memory + (1.0 - share) * (c.restart_s + l_d - c.durable_cost_s))
        if b > 0.0 and c.durable_cost_s > 0.0:
            y = math.sqrt(b * c.durable_cost_s / slope)
            cands.add(max((y - c.durable_cost_s) / (1.0 + a), l_d))
    if math.isfinite(w_m):  # where W_d = W_m: P_d = 2 (W_m - L_d + c_d)
        edge = (2.0 * (w_m - l_d + c.durable_cost_s) - c.durable_cost_s) / (1.0 + a)
        if edge > l_d:
            cands.add(edge)  # the memory piece's start (a tie restarts from memory)
            cands.add(_last_durable_tau(edge, a, c, l_d, w_m))  # the storage piece's end
    return max(sorted(cands), key=lambda tau: goodput_two_tier(k, tau, c, mtbf_s))


def _last_durable_tau(edge: float, a: float, c: TierCosts, l_d: float, w_m: float) -> float:
    """The largest ``tau_d`` below ``edge`` whose durable point is strictly the newer one
    (``W_d < W_m``, as ``evaluate`` decides it). ``G`` jumps down at the edge, where a tie
    restarts from memory, so while the storage piece still rises there its best value is
    this one, not the edge (hypothesis found 1.0 returned where 1.01 was better)."""
    tau = edge
    for _ in range(64):  # W_d grows by about (1 + a)/2 per ulp of tau: a few steps
        tau = math.nextafter(tau, -math.inf)
        if tau <= l_d or _durable_age(tau, a, c, l_d) < w_m:
            break
    return max(tau, l_d)


def _durable_age(tau: float, a: float, c: TierCosts, l_d: float) -> float:
    """``W_d`` at a finite ``tau``: the work a durable-kind failure loses, on average."""
    block = max(c.durable_cost_s, l_d - tau)
    period = tau * (1.0 + a) + block
    return period / 2.0 + l_d - block


def _best_k(c: TierCosts, mtbf_s: float) -> tuple[int, float, float]:
    """(K_m, tau_d, goodput) of the best snapshot interval (module docstring)."""
    lam = 0.0 if math.isinf(mtbf_s) else 1.0 / mtbf_s

    def score(k: int) -> tuple[float, float]:
        tau = best_durable_interval_s(k, c, mtbf_s)
        return goodput_two_tier(k, tau, c, mtbf_s), tau

    rate = lam * c.survives
    guess = math.sqrt(2.0 * c.memory_cost_s / rate) / c.step_s if rate > 0 else 1.0
    hi = max(2, math.ceil(min(1e9, 4.0 * guess)) + 2)  # a denormal f: guess is inf
    if hi <= _SCAN:
        ks = range(1, hi + 1)
    else:  # golden-section search on integers, then the neighbours of where it ends
        lo_k, hi_k = 1, hi
        while hi_k - lo_k > 8:
            m1 = lo_k + int((hi_k - lo_k) * 0.382)
            m2 = lo_k + int((hi_k - lo_k) * 0.618)
            if score(m1)[0] < score(m2)[0]:
                lo_k = m1
            else:
                hi_k = m2
        ks = range(lo_k, hi_k + 1)
    best = max(((score(k), k) for k in ks), key=lambda x: (x[0][0], -x[1]))
    (g, tau), k = best
    return k, tau, g


def recommend(c: TierCosts, mtbf_s: float) -> dict[str, Any]:
    """Both intervals, the two-tier goodput and durable-only's, as plain JSON values.

    ``memory_every_steps`` is None when the tier does not pay (then ``goodput`` equals
    ``durable_only.goodput``); ``durable_interval_min`` is None when no failure needs
    durable storage (``f = 1``: save durably for the run's end and for layout changes).
    """
    off_tau = best_durable_interval_s(None, c, mtbf_s)
    off = evaluate(None, off_tau, c, mtbf_s)
    k, tau, g = _best_k(c, mtbf_s)
    if g <= off["goodput"]:
        k, tau = None, off_tau
    on = evaluate(k, tau, c, mtbf_s)

    def minutes(x: float) -> float | None:
        return None if math.isinf(x) else x / 60.0

    return {
        "memory_every_steps": k,
        "memory_interval_s": None if k is None else k * c.step_s,
        "durable_interval_min": minutes(tau),
        "goodput": on["goodput"],
        "lost_per_failure_s": on["lost_per_failure_s"],
        "steps_lost_per_failure": on["lost_per_failure_s"] / c.step_s,
        "restart_per_failure_s": on["restart_per_failure_s"],
        "durable_only": {
            "durable_interval_min": minutes(off_tau),
            "goodput": off["goodput"],
            "lost_per_failure_s": off["lost_per_failure_s"],
            "steps_lost_per_failure": off["lost_per_failure_s"] / c.step_s,
        },
        "gain": on["goodput"] - off["goodput"],
    }


def memory_every_steps(
    step_s: float, cost_s: float, landed_s: float, mtbf_s: float, survives: float
) -> int:
    """The snapshot interval a running job takes (``memory.every_steps = "auto"``): the
    ``K_m`` that minimises the memory tier's own waste per second of training, ``a + lambda
    f W_m`` (``_memory``: blocking, one generation in flight, and the work a memory restart
    loses), from the job's measured step time, snapshot blocking and time to land. The
    durable interval does not move it (a failure memory survives restarts from memory at
    any durable interval worth having), so a job decides it without knowing its durable
    costs. Every step when snapshots are cheap: ``K_m = 1`` once ``c_m`` is well under
    ``lambda f t^2 / 2``."""
    c = TierCosts(
        step_s=step_s,
        memory_cost_s=cost_s,
        memory_restore_s=0.0,
        durable_cost_s=0.0,
        restart_s=0.0,
        durable_restore_s=0.0,
        survives=survives,
        memory_landed_s=max(cost_s, landed_s),
    )
    rate = (0.0 if math.isinf(mtbf_s) else 1.0 / mtbf_s) * survives
    if rate <= 0:
        raise ConfigError("memory_every_steps needs a finite mtbf_s and survives > 0")
    guess = math.sqrt(2.0 * max(cost_s, 1e-12) / rate) / step_s
    hi = max(2, min(_SCAN, math.ceil(4.0 * guess) + 2))

    def waste(k: int) -> float:
        a, lost = _memory(k, c)
        return a + rate * lost

    return min(range(1, hi + 1), key=lambda k: (waste(k), k))
