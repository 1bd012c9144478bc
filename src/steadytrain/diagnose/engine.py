"""The diagnosis engine: one run directory's records in, one incident per fault out.

``diagnose(run)`` loads the records once (``inputs.load``), runs every detector -- the
stragglers and host contention (``stragglers``), data slowdowns every rank shares
(``shared``), the read order (``data_order``) and ``failures`` (crash, node loss, hang,
checkpoint, restart loop; skipped while it does not import) -- merges what
they found into one incident per fault (same kind, same nodes, overlapping or adjacent
steps) and sorts by ``first_step``. Pure: it reads the records and writes nothing, so the
report, ``report --json``, the HTML and ``demo --incident`` all print the same list.
A detector that fails is logged and skipped: one broken detector must not hide the rest.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords, load

__all__ = ["diagnose", "detectors", "merge"]

log = logging.getLogger("steadytrain.diagnose")

Detector = Callable[[RunRecords], list[Incident]]
# module names under steadytrain.diagnose, each with ``detect(rec) -> list[Incident]``;
# an absent or broken one (failures.py lands separately) is skipped
_DETECTORS = ("stragglers", "shared", "data_order", "failures")


def detectors() -> list[tuple[str, Detector]]:
    out = []
    for name in _DETECTORS:
        try:
            mod = importlib.import_module(f"steadytrain.diagnose.{name}")
        except ImportError as e:
            if getattr(e, "name", None) != f"steadytrain.diagnose.{name}":
                log.warning("diagnosis detector %s does not import: %s", name, e)
            continue
        fn = getattr(mod, "detect", None)
        if callable(fn):
            out.append((name, fn))
    return out


def diagnose(run: str | os.PathLike[str] | RunRecords) -> list[Incident]:
    """Every incident of ``run`` (a run directory or its loaded records), sorted by
    ``first_step`` (incidents without a step last)."""
    rec = run if isinstance(run, RunRecords) else load(run)
    found: list[Incident] = []
    for name, fn in detectors():
        try:
            found += fn(rec)
        except Exception:  # a detector's bug must not hide the other detectors' incidents
            log.exception("diagnosis detector %s failed on %s", name, rec.run_dir)
    return merge(found)


def _key(i: Incident) -> tuple[Any, ...]:
    return (i.first_step is None, i.first_step or 0, i.last_step or 0, i.kind)


def merge(incidents: list[Incident]) -> list[Incident]:
    """One incident per fault: incidents of one kind on the same nodes whose step spans
    overlap (or touch) become one spanning both, their costs added."""
    out: list[Incident] = []
    for inc in sorted(incidents, key=_key):
        for o in out:
            if _same_fault(o, inc):
                _absorb(o, inc)
                break
        else:
            out.append(inc)
    return sorted(out, key=_key)


def _same_fault(a: Incident, b: Incident) -> bool:
    if a.kind != b.kind or sorted(a.nodes) != sorted(b.nodes):
        return False
    if a.first_step is None or b.first_step is None:
        return False
    a_last = a.last_step if a.last_step is not None else a.first_step
    return b.first_step <= a_last + 1


def _absorb(a: Incident, b: Incident) -> None:
    a.last_step = max(x for x in (a.last_step, b.last_step, b.first_step) if x is not None)
    a.ranks = sorted(set(a.ranks) | set(b.ranks))
    a.lost_s += b.lost_s
    for k, v in b.evidence.items():
        a.evidence.setdefault(k, v)
    if a.t is None:
        a.t = b.t
