"""The restart ledger: every attempt's start-up and every restart, phase by phase (issue 44).

A restart is one window of wall time, from the failed attempt's last progress (its newest
``step`` or ``ok`` ``checkpoint`` record on any rank, as goodput's ``restart_gap`` has it)
to the next attempt's first productive step.
Its phases, in the order they happen, each from records alone:

- ``detection_s``: last progress -> the failure decided: the first record of the failure on
  any rank (a crash ``job_end``/``rank_end``: a peer's error, the agent's SIGTERM; a watchdog
  ``hang`` verdict);
- ``teardown_s``: -> the last process of the attempt gone: the newest record of the attempt
  on any rank (each rank's ``rank_end`` is written as it leaves);
- ``relaunch_s``: -> the new attempt's birth (rank 0's process, as goodput's ``restart_gap``
  dates it). When no rank of the failed attempt recorded the failure (every one was killed
  at once, a node loss), detection and teardown cannot be told apart from the relaunch:
  the three are one ``undivided_s``, named as such;
- the new attempt's start-up (``job_start.startup_phases``, ``run_phases.py``):
  ``imports_s``, ``build_s`` (the user's build: the remainder), ``group_s``, ``setup_s``;
  a ledger written before the phases has one ``startup_s`` in their place;
- ``restore_s``;
- ``first_step_excess_s``: the first step's time beyond a steady step of the same attempt
  (the median of its next ``STEADY_STEPS`` steps): compile, warm caches, the other ranks'
  own start-up. The steady part is work, not restart.

So ``sum(phases) + steady_step_s == wall_s`` by construction, each phase >= 0 (a clock that
disagrees between nodes is clamped, never negative). Pure: ``restart_rows(records)`` reads a
``diagnose.inputs.RunRecords``; the report prints its rows (text, JSON, HTML bars) and the
planner uses their mean (planning/run_costs.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from steadytrain.printable import html_text
from steadytrain.run_phases import STARTUP_PHASES

__all__ = [
    "GAP_PHASES",
    "PHASES",
    "STEADY_STEPS",
    "attempt_rows",
    "phase_words",
    "restart_lines",
    "restart_rows",
    "restarts_html",
]

GAP_PHASES = ("detection_s", "teardown_s", "relaunch_s", "undivided_s")
PHASES = (*GAP_PHASES, *STARTUP_PHASES, "startup_s", "restore_s", "first_step_excess_s")
STEADY_STEPS = 20  # steps after an attempt's first that make its steady step (median)
_CLEAN = ("finished", "interpreter_exit")
_COLORS = {
    "detection_s": "#e57373",
    "teardown_s": "#ffb74d",
    "relaunch_s": "#fff176",
    "undivided_s": "#bdbdbd",
    "imports_s": "#81c784",
    "build_s": "#4db6ac",
    "group_s": "#64b5f6",
    "setup_s": "#9575cd",
    "startup_s": "#90a4ae",
    "restore_s": "#f06292",
    "first_step_excess_s": "#a1887f",
}


def _num(v: Any) -> float | None:
    """A finite number >= 0, else None (records are untrusted input)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v) if v >= 0 else None


def _startup(start: dict[str, Any]) -> dict[str, float]:
    """An attempt's start-up phases from its ``job_start`` (one ``startup_s`` when the record
    has no valid split), then its restore."""
    startup = _num(start.get("startup_s")) or 0.0
    given = start.get("startup_phases")
    given = given if isinstance(given, dict) else {}
    split = {k: _num(given.get(k)) for k in STARTUP_PHASES}
    out: dict[str, float]
    if all(v is not None for v in split.values()) and given:
        # scaled onto startup_s, so the window still adds up if a record was edited
        total = sum(split.values())  # type: ignore[arg-type]
        f = startup / total if total > 0 else 0.0
        out = {k: v * f for k, v in split.items()}  # type: ignore[operator]
    else:
        out = {"startup_s": startup}
    out["restore_s"] = _num(start.get("restore_s")) or 0.0
    return out


def _steps_by_attempt(records: Any) -> dict[int, list[tuple[float, float]]]:
    """Attempt index -> its step records' ``(t, step_s)`` in order (rank 0's ledger)."""
    out: dict[int, list[tuple[float, float]]] = {}
    cols = records.steps
    for i in range(len(cols)):
        out.setdefault(int(cols.attempt[i]), []).append((cols.t[i], cols.step_s[i]))
    return out


def _first_step(start: dict[str, Any], steps: list[tuple[float, float]]) -> dict[str, Any]:
    """The attempt's first step: when it ended, and its excess over a steady step."""
    if not steps:
        return {"first_step_t": None, "steady_step_s": None, "first_step_excess_s": None}
    t_first = steps[0][0]
    steady = [s for _, s in steps[1 : 1 + STEADY_STEPS] if _num(s) is not None]
    if not steady:
        return {"first_step_t": t_first, "steady_step_s": None, "first_step_excess_s": None}
    median = statistics.median(steady)
    took = max(0.0, t_first - float(start["t"]))  # job_start -> the first step's record
    return {
        "first_step_t": t_first,
        "steady_step_s": min(median, took),
        "first_step_excess_s": max(0.0, took - median),
    }


def attempt_rows(records: Any) -> list[dict[str, Any]]:
    """One row per attempt: ``{"attempt", "phases": {...start-up, restore, first step's
    excess}, "steady_step_s"}``."""
    by = _steps_by_attempt(records)
    rows = []
    for i, start in enumerate(records.starts):
        first = _first_step(start, by.get(i, []))
        phases = _startup(start)
        if first["first_step_excess_s"] is not None:
            phases["first_step_excess_s"] = first["first_step_excess_s"]
        rows.append(
            {
                "attempt": start.get("attempt", i),
                "phases": phases,
                "steady_step_s": first["steady_step_s"],
            }
        )
    return rows


def _attempt_facts(records: Any, number: Any, index: int) -> dict[str, Any]:
    """The failed attempt's last progress, first failure record and newest record, over
    rank 0's ledger and every rank file."""
    progress: list[float] = []
    failed: list[float] = []
    seen: list[float] = []
    cols = records.steps
    for i in range(len(cols)):
        if cols.attempt[i] == index:
            progress.append(cols.t[i])
    k = -1
    for e in records.events:
        kind = e.get("type")
        if kind == "job_start":
            k += 1
            continue
        t = _num(e.get("t"))
        if t is None:
            continue
        if kind == "hang" and e.get("attempt") == number:
            failed.append(t)  # a recovered verdict arrives in a later attempt: by number
        elif k != index:
            continue
        elif kind == "checkpoint" and e.get("ok", True):  # a failed save kept nothing
            progress.append(t)
        elif kind == "job_end":
            seen.append(t)
            if e.get("reason", "finished") not in _CLEAN:
                failed.append(t)
    for summary in records.view.ranks.values():
        for a in summary.attempts:
            if a.get("attempt") != number:
                continue
            last = _num(a.get("last_t"))
            if last is not None:
                progress.append(last)
            end = a.get("end") or {}
            t = _num(end.get("t"))
            if t is not None:
                seen.append(t)
                if end.get("reason", "finished") not in _CLEAN:
                    failed.append(t)
    start_t = _num(records.starts[index].get("t")) or 0.0
    last_progress = max(progress, default=start_t)
    return {
        "last_progress_t": last_progress,
        "decided_t": min((t for t in failed if t >= last_progress), default=None),
        "gone_t": max([*seen, *failed, last_progress]),
    }


def restart_rows(records: Any) -> list[dict[str, Any]]:
    """One row per restart (every attempt after the first)::

        {"attempt": the new attempt, "after": the failed one, "reason": its job_end reason,
         "wall_s": last progress -> the new attempt's first step, "steady_step_s",
         "phases": {name: seconds, in PHASES order, only those known}}

    ``sum(phases) + steady_step_s == wall_s`` (module docstring); without a steady step
    (an attempt of one step) the window ends at the new attempt's ``job_start``."""
    starts = records.starts
    ends = records.ends()
    by = _steps_by_attempt(records)
    rows = []
    for i in range(1, len(starts)):
        start = starts[i]
        facts = _attempt_facts(records, starts[i - 1].get("attempt", i - 1), i - 1)
        startup = _startup(start)
        job_t = float(start["t"])
        born = job_t - sum(startup.values())  # rank 0's birth, as goodput dates the attempt
        t1 = facts["last_progress_t"]
        gone = max(t1, facts["gone_t"])
        t4 = max(gone, born)
        phases: dict[str, float] = {}
        if facts["decided_t"] is None:
            phases["undivided_s"] = t4 - t1
        else:
            t2 = min(max(t1, facts["decided_t"]), gone)
            phases.update(detection_s=t2 - t1, teardown_s=gone - t2, relaunch_s=t4 - gone)
        # a clock that disagrees (born before the last record): the start-up's share shrinks
        over = max(0.0, gone - born)
        for k, v in startup.items():
            cut = min(v, over)
            phases[k], over = v - cut, over - cut
        first = _first_step(start, by.get(i, []))
        end_t = job_t
        if first["first_step_excess_s"] is not None:
            phases["first_step_excess_s"] = first["first_step_excess_s"]
            end_t = first["first_step_t"]
        end = ends.get(i - 1) or {}
        rows.append(
            {
                "attempt": start.get("attempt", i),
                "after": starts[i - 1].get("attempt", i - 1),
                "reason": end.get("reason", "crashed (no job_end)"),
                "wall_s": max(0.0, end_t - t1),
                "steady_step_s": first["steady_step_s"] if end_t != job_t else None,
                "phases": {k: phases[k] for k in PHASES if k in phases},
            }
        )
    return rows


def _label(name: str) -> str:
    return name[:-2].replace("_", " ")


def phase_words(phases: dict[str, float]) -> str:
    """``detection 0.01, teardown 0.00, ... s``: phases as the text report prints them."""
    return ", ".join(f"{_label(k)} {v:.2f}" for k, v in phases.items()) + " s"


def restart_lines(summary: dict[str, Any]) -> list[str]:
    """The report's text lines: the first attempt's start-up in phases, then one line per
    restart, its wall time and phases."""
    out = []
    first = (summary.get("attempt_phases") or [None])[0]
    if first is not None:
        out.append(f"attempt {first['attempt']} start-up: {phase_words(first['phases'])}")
    for r in summary.get("restart_phases") or []:
        out.append(
            f"restart into attempt {r['attempt']}: {r['wall_s']:.2f} s from the last "
            f"progress to the first step: {phase_words(r['phases'])}"
        )
    return out


def restarts_html(summary: dict[str, Any]) -> str:
    """One stacked bar per restart (plain HTML: widths proportional to the longest
    restart), with a legend and the seconds of each phase."""
    rows = summary.get("restart_phases") or []
    if not rows:
        return ""
    longest = max(sum(r["phases"].values()) for r in rows) or 1.0
    e = html_text
    bars = []
    for r in rows:
        segs = "".join(
            f'<span class="ph" title="{e(_label(k))} {v:.2f} s" style="display:inline-block;'
            f'height:18px;width:{100 * v / longest:.3f}%;background:{_COLORS[k]}"></span>'
            for k, v in r["phases"].items()
            if v > 0
        )
        words = ", ".join(f"{e(_label(k))} {v:.2f} s" for k, v in r["phases"].items())
        bars.append(
            f'<div class="restart"><b>attempt {e(r["after"])} -> {e(r["attempt"])}</b> '
            f"({r['wall_s']:.2f} s; {e(r['reason'])})"
            f'<div style="width:100%;white-space:nowrap">{segs}</div>'
            f"<small>{words}</small></div>"
        )
    legend = " ".join(
        f'<span style="background:{c};padding:0 6px">{e(_label(k))}</span>'
        for k, c in _COLORS.items()
    )
    return (
        "<h2>Restarts, phase by phase</h2><p>From the failed attempt's last progress to "
        f"the next attempt's first step (docs/monitoring.md). {legend}</p>" + "".join(bars)
    )
