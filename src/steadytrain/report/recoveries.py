"""The report's in-place recoveries: which path each recovery took and why (issue 44).

One row per ``inplace_recovery`` record of the ledger (``run_inplace.recovery_record``,
docs/format.md): ``in_place`` (the survivors kept their processes, rolled back from memory
and regrouped with the replaced rank) or ``whole_restart`` (a fallback, with its reason).
The seconds themselves are booked by the goodput arithmetic as any restart (the in-place
gap between the attempt's ``job_end`` and the next ``job_start``); these rows say which
path and where its time went. Pure: records in, rows and lines out.
"""

from __future__ import annotations

from typing import Any

from steadytrain.printable import html_text

__all__ = ["PHASES", "recovery_lines", "recovery_rows", "recoveries_html"]

PHASES = ("detection_s", "regroup_s", "restore_s", "rebuild_s", "redo_s")
_PATHS = {"in_place": "in place", "whole_restart": "whole restart"}


def _num(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9
    return float(v) if ok else None


def recovery_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``inplace_recovery`` record as a row: attempt, path, failed ranks, steps, the
    reason, and its phases (only numbers that make sense: a record is untrusted input)."""
    rows = []
    for e in events:
        if e.get("type") != "inplace_recovery" or e.get("path") not in _PATHS:
            continue
        raw = e.get("phases") if isinstance(e.get("phases"), dict) else {}
        phases = {k: v for k in PHASES if (v := _num(raw.get(k))) is not None}
        rows.append(
            {
                "attempt": e.get("attempt"),
                "path": e["path"],
                "failed_ranks": list(e.get("failed_ranks") or []),
                "from_step": e.get("from_step"),
                "step": e.get("step"),
                "why": str(e.get("why") or ""),
                "fallback": e.get("fallback"),
                "phases": phases,
                "wall_s": sum(phases.values()),
                "redo_done": e.get("redo_done", True),
            }
        )
    return rows


def _words(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in phases.items()) or "-"


def recovery_lines(summary: dict[str, Any]) -> list[str]:
    """The text report's lines: one per recovery, its path, reason and phases."""
    out = []
    for r in summary.get("recoveries") or []:
        ranks = ", ".join(map(str, r["failed_ranks"])) or "?"
        if r["path"] == "in_place":
            out.append(
                f"recovery in place (attempt {r['attempt']}): rank {ranks} lost at step "
                f"{r['from_step']}, rolled back to {r['step']}, {r['wall_s']:.2f} s: "
                f"{_words(r['phases'])}" + ("" if r["redo_done"] else " (redo cut short)")
            )
        else:
            out.append(
                f"recovery by whole restart (before attempt {r['attempt']}): rank {ranks} at "
                f"step {r['from_step']}: {r['fallback']}: {r['why']}"
            )
    return out


def recoveries_html(summary: dict[str, Any]) -> str:
    rows = summary.get("recoveries") or []
    if not rows:
        return ""
    e = html_text
    body = "".join(
        f"<tr><td>{e(r['attempt'])}</td><td>{e(_PATHS[r['path']])}</td>"
        f"<td>{e(', '.join(map(str, r['failed_ranks'])))}</td><td>{e(r['from_step'])}</td>"
        f"<td>{e(r['step'])}</td><td>{e(r['fallback'] or '')} {e(r['why'])}</td>"
        f"<td>{e(_words(r['phases']))}</td></tr>"
        for r in rows
    )
    return (
        "<h2>Recoveries: in place or whole restart</h2><table><tr><th>attempt</th>"
        "<th>path</th><th>lost ranks</th><th>at step</th><th>rolled back to</th>"
        f"<th>why</th><th>phases</th></tr>{body}</table>"
    )
