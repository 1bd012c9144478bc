"""The pieces the straggler rules share: one rank's slow run of windows (``Episode``), a
window's value for a signal, folding a rank's windows into one, its cost in a window, the
run's window-to-window noise, runs of flagged windows, and a step's time and attempt.
``stragglers`` (per rank) and ``shared`` (the whole job) judge with them;
``straggler_cause`` names an episode's cause, ``straggler_incidents`` turns episodes into
incidents."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from steadytrain.diagnose.inputs import RunRecords
from steadytrain.monitor.windows import Window, compute_wait_s

__all__ = ["Episode", "attempt_of", "excess_s", "fold_windows", "jitter", "runs_of",
           "signal_value", "t_of"]  # fmt: skip


@dataclass
class Episode:
    """One rank's slow run of windows in one signal, and what judged it."""

    rank: int
    signal: str  # "data" or "compute"
    windows: list[int] = field(default_factory=list)  # window indices, slow ones
    kind: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    # window index -> s/step the others waited for this rank's forward pass, beside a
    # throttled rank's slow next() (``_throttled_compute``)
    compute_waits: dict[int, float] = field(default_factory=dict)


def jitter(series: list[float | None]) -> float:
    """Robust window-to-window noise of a series: 1.4826 x the median absolute first
    difference / sqrt(2) (a step change moves it once, noise every time)."""
    vals = [v for v in series if v is not None]
    d = [abs(b - a) for a, b in zip(vals, vals[1:], strict=False)]
    return 1.4826 * statistics.median(d) / math.sqrt(2) if d else 0.0


def runs_of(flags: list[bool]) -> list[list[int]]:
    """Runs of flagged windows, gaps of one unflagged window bridged."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i, f in enumerate(flags):
        if not f:
            continue
        if cur and i - cur[-1] > 2:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def signal_value(w: Window, signal: str) -> float | None:
    return w.per(w.data_wait_s) if signal == "data" else w.per(w.forward_s)


def excess_s(row: dict[int, Window], r: int, ref: float | None, signal: str) -> float:
    """Seconds rank ``r`` cost the job in this window: its excess data wait per step x the
    steps; for a slow forward pass, the others' wait its ratio implies
    (``windows.compute_wait_s``) x the steps."""
    w = row.get(r)
    v = None if w is None else signal_value(w, signal)
    if v is None or ref is None or w is None:
        return 0.0
    if signal == "compute":
        return compute_wait_s(w, ref) * w.n
    return max(0.0, v - ref) * w.n


def fold_windows(ws: list[Window]) -> Window:
    """Windows of one rank as one (sums add, p99: the median of the windows' maxima, so
    one outlier read does not speak for an episode)."""
    out = Window()
    p99s = [w.read_p99_s for w in ws if w.read_p99_s is not None]
    for w in ws:
        out.n += w.n
        out.step_s += w.step_s
        out.data_wait_s += w.data_wait_s
        if w.forward_s is not None:
            out.forward_s = (out.forward_s or 0.0) + w.forward_s
        if w.cache_misses is not None:
            out.cache_misses = (out.cache_misses or 0.0) + w.cache_misses
        if w.read_s is not None:
            out.read_s = (out.read_s or 0.0) + w.read_s
        if w.mem_first is not None and out.mem_first is None:
            out.mem_first = w.mem_first
        if w.mem_last is not None:
            out.mem_last = w.mem_last
        out.first_step = w.first_step if out.first_step is None else out.first_step
        out.last_step = w.last_step if w.last_step is not None else out.last_step
        out.host_n += w.host_n
        out.run_queue += w.run_queue
        out.cpus += w.cpus
        if w.steal is not None:
            out.steal = (out.steal or 0.0) + w.steal
        if w.throttled is not None:
            out.throttled = (out.throttled or 0.0) + w.throttled
    out.read_p99_s = statistics.median(p99s) if p99s else None
    return out


def t_of(rec: RunRecords, step: int) -> float | None:
    s = rec.steps
    found = None
    for i in range(len(s)):
        if s.step[i] == step:
            found = s.t[i]  # a redone step: its newest record
    return found


def attempt_of(rec: RunRecords, step: int) -> int | None:
    s = rec.steps
    found = None
    for i in range(len(s)):
        if s.step[i] == step and s.attempt[i] >= 0:
            found = int(s.attempt[i])
    return found
