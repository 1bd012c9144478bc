"""Incident replays: the failures steadytrain exists for, reproduced end to end on the node
harness (``steadytrain.testing.nodes``), each with and without its fix.

Each replay is a module here with ``replay(workdir, *, log) -> dict`` and is run by
``steadytrain demo --incident NAME`` and by its end-to-end test under ``tests/nodes/``.
The dict it returns (printed by ``demo --incident NAME --json``)::

    {
      "incident": NAME,
      "mode": "netns" | "loopback",           # the harness's, with "mode_reason"
      "incidents": [{"kind", "nodes", "ranks", "first_step", "last_step", "lost_s",
                     "evidence", "advice", "message", ..., "run"}],
      "expected": {RUN: [expectation, ...]},  # what was injected in each run (expect.py)
      "checks": {RUN: {"matched", "missed", "extra"}},  # the incidents against it
      "goodput": {"without_fix": float | None, "with_fix": float | None},
      "goodput_incl_startup": {...},          # the reports' own figures
      "runs": {"without_fix": {"run_dir", "report_html", ...}, "with_fix": {...}},
      "seconds": float,
      ...                                     # what the replay itself measured
    }

``incidents`` are the runs' reports' incidents (``steadytrain report --json``, from
steadytrain.diagnose), each tagged with ``run``; a replay injects a fault and measures
(goodput, timings, memory), but never writes a diagnosis of its own, so a replay whose
report misses the fault fails its check. ``matrix.py`` runs the same faults alone, together
and on several nodes (the diagnosis matrix, bench/diagnosis_matrix.py).

``goodput`` is each report's goodput (net of ``straggler_wait``: a rank 0 waiting inside a
collective for a rank that waits on data) over the run's wall time less its first start-up
(``common.goodput_after_startup``): a replay is tens of steps, and a first start-up of
seconds would decide the comparison that a weeks-long run amortises.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["INCIDENTS", "replay"]

# name -> module (under steadytrain.testing.incidents) and one line for --help
INCIDENTS: dict[str, tuple[str, str]] = {
    "storage": (
        "storage",
        "one node's object-store link slows mid-run: naive cache vs stage + prefetch",
    ),
    "loader-memory": (
        "loader_memory",
        "a growing-index loader fills /dev/shm on one rank; TokenLoader stays flat",
    ),
    "node-loss": (
        "node_loss",
        "a node is killed: the job continues, a staged spare joins, bit-exact",
    ),
    "hang": (
        "hang",
        "one node's link goes down: the hang watchdog restarts before the backend timeout",
    ),
    "noisy-loss": (
        "noisy_loss",
        "sequential reading of unshuffled documents vs global shuffle: loss variance",
    ),
}


def replay(name: str, workdir: str, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Run incident ``name`` under ``workdir``; progress goes to ``log``."""
    if name not in INCIDENTS:
        raise ValueError(f"unknown incident {name!r}: choose one of {', '.join(INCIDENTS)}")
    from steadytrain.testing.incidents.common import goodput_after_startup

    module = importlib.import_module(f"steadytrain.testing.incidents.{INCIDENTS[name][0]}")
    result = module.replay(workdir, log=log)
    # ``goodput``: net of the first start-up (common.goodput_after_startup); the report's
    # own figure, start-up included, stays in ``goodput_incl_startup``.
    result["goodput_incl_startup"] = result.get("goodput", {})
    runs = result.get("runs", {})
    result["goodput"] = {
        k: goodput_after_startup(runs[k]["run_dir"]) if runs.get(k, {}).get("run_dir") else None
        for k in result["goodput_incl_startup"]
    }
    return result
