"""The ``records_lost`` records of a ledger, as the report shows them.

A writer whose disk failed for longer than its bounded buffer lasted (monitor/appender.py)
drops the oldest unwritten records and, once writing works again, writes one
``records_lost`` record where they would have been: the steps and times they covered, how
many, which file, and why. The goodput figures can only count what the ledger holds, so the
report lists those spans (``records_lost`` in ``--json``) and warns about them instead of
printing a low goodput with no reason.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LostSpans", "lost_span", "lost_warning"]

_MAX_SPANS = 1000  # spans kept for the report; the rest are only counted


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if not math.isfinite(v) or v < 0 or v != int(v) or v >= 2**53:
        return None
    return int(v)


def _time(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def lost_span(rec: dict[str, Any]) -> dict[str, Any] | None:
    """One ``records_lost`` record as a report row, or None when it is not one (or its
    count is not a non-negative integer): fields that fail their type read as null."""
    if rec.get("type") != "records_lost":
        return None
    count = _int(rec.get("count"))
    if count is None:
        return None
    first, last = _int(rec.get("first_step")), _int(rec.get("last_step"))
    t0, t1 = _time(rec.get("t0")), _time(rec.get("t1"))
    file, reason = rec.get("file"), rec.get("reason")
    raw = rec.get("types")
    types = {}
    if isinstance(raw, dict):  # records lost per type; anything else in it is ignored
        for k, v in list(raw.items())[:20]:
            if (n := _int(v)) is not None:
                types[str(k)[:40]] = n
    return {
        "file": file[:200] if isinstance(file, str) else None,
        "first_step": first,
        "last_step": last,
        "count": count,
        "types": types,
        "t0": t0,
        "t1": t1,
        "span_s": t1 - t0 if t0 is not None and t1 is not None and t1 >= t0 else None,
        "reason": reason[:80] if isinstance(reason, str) else None,
    }


class LostSpans:
    """Collects the spans of a ledger read once (``add`` every record)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.count = 0  # records lost, every span counted

    def add(self, rec: dict[str, Any]) -> None:
        span = lost_span(rec)
        if span is None:
            return
        self.count += span["count"]
        if len(self.spans) < _MAX_SPANS:
            self.spans.append(span)


def lost_warning(spans: list[dict[str, Any]]) -> list[str]:
    """One line per span, for the text report."""
    out = []
    for s in spans:
        steps = (
            f"steps {s['first_step']}..{s['last_step']}"
            if s["first_step"] is not None
            else "no step records"
        )
        during = f" over {s['span_s']:.1f} s" if s["span_s"] is not None else ""
        out.append(
            f"warning: {s['count']} record(s) of {s['file'] or 'a run file'} were lost "
            f"({s['reason'] or 'write failed'}): {steps}{during}; the run directory's disk "
            "failed and the figures above leave them out (docs/operations.md)"
        )
    return out
