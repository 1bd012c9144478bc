"""``data-order``: the loss jumps with the order the data is read in, found from one run.

Documents stored in topic order and read sequentially give batches of one topic at a time:
the loss steps up and down with each block, on top of its smooth fall. A shuffled order
gives consecutive batches that are independent draws, so what is left of the loss around
its own smooth trend is white noise. The test, on the loss per step (rank 0's ledger, else
its step trace) after a burn-in:

1. the trend: a least-squares cubic in log(step) (a training loss falls like a power of
   the step; the fit follows that fall without following blocks of a few steps);
2. the residuals' serial structure: the Ljung-Box statistic ``Q`` over lags 1..``LAGS``
   (chi-square with ``LAGS`` degrees of freedom for white residuals, i.e. for a shuffled
   order: 99.9 % of white series stay below ~22.5); topic blocks of 2-6 steps give 25-55;
   and the lag-1 autocorrelation ``rho1`` (blocks of 2 steps: ~0.27, of 3-8: ~0.45-0.6);
   structure counts only with ``rho1`` positive (``RHO_Q``): an optimizer that overshoots
   makes residuals alternate, which is not an order (a topic change every single step is
   not told from that: not found);
3. the size: the residuals' std against the loss level (``relative_noise``), so a series
   flat to the fourth digit is not an incident;
4. the configured order (``job_start`` config ``data.shuffle``): ``global`` (or ``block``)
   reads shuffled data: never ``data-order``; ``sequential``/``none``: ``Q >= Q_ORDERED``
   with ``rho1 >= RHO_Q``, or ``rho1 >= RHO_ORDERED`` with ``Q >= Q_RHO_ORDERED``; an
   unknown order (a library run): the stricter ``*_UNKNOWN`` thresholds.

The evidence also holds the step-to-step variance (``var(loss[t+1] - loss[t])``, the
replay's number) and its ratio to what white residuals imply (``2 var(resid)``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords

__all__ = ["detect", "losses", "order_of", "serial_structure"]

BURN_IN = 8  # the steepest fall from ln(vocab) comes first: left out
MIN_POINTS = 16
LAGS = 6
Q_ORDERED = 28.0
Q_UNKNOWN = 40.0
# Blocks of several steps make consecutive residuals alike: Q counts only with a positive
# lag-1 autocorrelation (an optimizer that overshoots makes them alternate: the noisy-loss
# replay's global run has rho1 -0.31), and a high one counts with a lower Q (the replay's
# sequential run: rho1 0.56, Q 26.8). 1 of 3,000 simulated white series passes either.
RHO_Q = 0.2
RHO_ORDERED, Q_RHO_ORDERED = 0.45, 15.0
RHO_UNKNOWN, Q_RHO_UNKNOWN = 0.55, 20.0
REL_ORDERED = 0.005
REL_UNKNOWN = 0.02
_SHUFFLED = {"global", "block", "random", "true", "1", "yes"}
_ORDERED = {"sequential", "none", "off", "false", "0", "no", "ordered"}


def order_of(starts: list[dict[str, Any]]) -> str | None:
    """The configured read order of the newest attempt: ``"shuffled"``, ``"ordered"`` or
    None (not said). Reads ``data.shuffle`` (steadytrain train) or a top-level
    ``shuffle`` (a library run's own config)."""
    for st in reversed(starts):
        cfg = st.get("config")
        if not isinstance(cfg, dict):
            continue
        data = cfg.get("data")
        for v in ((data or {}).get("shuffle") if isinstance(data, dict) else None,
                  cfg.get("shuffle")):  # fmt: skip
            if v is None:
                continue
            word = str(v).strip().lower()
            if word in _SHUFFLED:
                return "shuffled"
            if word in _ORDERED:
                return "ordered"
    return None


def losses(rec: RunRecords) -> list[tuple[int, float]]:
    """``(step, loss)``: each step's newest record in rank 0's ledger, else in its trace."""
    by_step: dict[int, float] = {}
    s = rec.steps
    for i in range(len(s)):
        v = s.loss[i]
        if not math.isnan(v):
            by_step[int(s.step[i])] = v
    if not by_step:
        by_step = _trace_losses(rec.run_dir)
    return sorted(by_step.items())


def _trace_losses(run_dir: Path) -> dict[int, float]:
    from steadytrain.monitor.records import iter_trace

    path = run_dir / "trace-rank0.jsonl"
    out: dict[int, float] = {}
    if path.is_file():
        for r in iter_trace(path):
            if r.get("loss") is not None:
                out[int(r["step"])] = float(r["loss"])
    return out


def serial_structure(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """``{"q", "relative_noise", "step_variance", "white_ratio", "n"}`` of the loss
    around its smooth trend, or None when too short or degenerate."""
    import numpy as np

    if len(points) < MIN_POINTS:
        return None
    t = np.log(np.asarray([max(1, p[0]) for p in points], dtype=float))
    x = np.asarray([p[1] for p in points], dtype=float)
    if not np.all(np.isfinite(x)) or t.std() == 0:
        return None
    a = np.vander((t - t.mean()) / t.std(), 4)
    coef, *_ = np.linalg.lstsq(a, x, rcond=None)
    r = x - a @ coef
    r = r - r.mean()
    v = float((r * r).sum())
    n = len(r)
    level = float(np.median(np.abs(x)))
    if v <= 0 or level <= 0:
        return None
    q = n * (n + 2) * sum(float((r[:-k] * r[k:]).sum() / v) ** 2 / (n - k)
                          for k in range(1, LAGS + 1))  # fmt: skip
    d = np.diff(x)
    step_var = float(d.var(ddof=1)) if len(d) > 1 else 0.0
    resid_var = v / n
    return {
        "q": q,
        "rho1": float((r[:-1] * r[1:]).sum() / v),
        "relative_noise": math.sqrt(resid_var) / level,
        "step_variance": step_var,
        "white_ratio": step_var / (2 * resid_var),
        "n": float(n),
    }


def detect(rec: RunRecords) -> list[Incident]:
    order = order_of(rec.starts)
    if order == "shuffled":
        return []  # a shuffled read order cannot be the cause
    pts = losses(rec)
    burn = max(BURN_IN, len(pts) // 5)
    pts = [p for p in pts if p[0] > burn]
    st = serial_structure(pts)
    if st is None:
        return []
    if order == "ordered":
        q_min, rel_min, rho_min, q_rho = Q_ORDERED, REL_ORDERED, RHO_ORDERED, Q_RHO_ORDERED
    else:
        q_min, rel_min, rho_min, q_rho = Q_UNKNOWN, REL_UNKNOWN, RHO_UNKNOWN, Q_RHO_UNKNOWN
    rho1, q = st["rho1"], st["q"]
    structured = (rho1 >= RHO_Q and q >= q_min) or (rho1 >= rho_min and q >= q_rho)
    if not structured or st["relative_noise"] < rel_min:
        return []
    jumps = [(abs(b[1] - a[1]), b[0], b[1] - a[1]) for a, b in zip(pts, pts[1:], strict=False)]
    size, at, signed = max(jumps)
    ev = {
        **st,
        "q_threshold": q_min,
        "rho1_threshold": rho_min,
        "lags": LAGS,
        "configured_order": order or "unknown",
        "largest_jump": signed,
        "largest_jump_step": at,
        "burn_in_steps": burn,
    }
    said = "read in order (data.shuffle=sequential)" if order == "ordered" else (
        "read in an order the run did not record")  # fmt: skip
    msg = (
        f"the loss jumps from step to step with structure its smooth trend does not explain "
        f"(Ljung-Box Q {st['q']:.0f} over {LAGS} lags, white noise stays below ~22; lag-1 "
        f"autocorrelation {st['rho1']:.2f}; residual "
        f"{st['relative_noise']:.1%} of the loss; largest jump {signed:+.3f} at step {at}) "
        f"and the data is {said}: batches follow the dataset's storage order"
    )
    return [Incident(kind="data-order", first_step=pts[0][0], last_step=pts[-1][0],
                     evidence=ev, message=msg)]  # fmt: skip
