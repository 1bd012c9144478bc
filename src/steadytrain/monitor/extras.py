"""Extra step-record fields from a loader's counters, without clashing with the meter's own.

``GoodputMeter.step(step, tokens=..., data_wait_s=..., **extra)`` stores ``extra`` in the
step record. ``TokenLoader.metrics()`` also has ``tokens`` and ``data_wait_s`` (the loader's
own view: this rank's micro-batches, time inside ``next()``), so splatting it straight into
``step()`` is a ``TypeError``. ``loader_fields`` keeps every numeric counter and renames
the ones the meter owns with a ``loader_`` prefix, the names the ledger has always used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["METER_KEYS", "loader_fields"]

# The step record's own fields (monitor/ledger.step_record) and the meter's keywords.
METER_KEYS = frozenset(
    {"type", "step", "tokens", "data_wait_s", "compute_s", "checkpoint_block_s", "loss", "t"}
)


def loader_fields(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``metrics`` (e.g. ``loader.metrics()``) as keyword arguments for ``meter.step``:
    numbers only (booleans and anything else dropped), clashing names prefixed."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"loader_{k}" if k in METER_KEYS else k] = v
    return out
