"""An attempt's start-up, phase by phase (issue 44): what ``Run`` can see of its own start.

A restart costs the failed attempt's teardown, the relaunch, and then every rank's start-up
again; to shorten it one must know which part is long. ``Run`` sees four instants of its own
process: its birth (``run_birth.py``), the import of ``steadytrain.run`` (torch is imported
by then: ``run.py`` imports ``torch.distributed``), its own entry (``Run.__enter__``) and the
end of its restore. Between them:

- ``imports_s``: interpreter and imports, birth -> ``steadytrain.run`` imported;
- ``build_s``: the user's build, imported -> ``Run`` entry. Run cannot see inside it: it is
  the remainder, named as such (the model, the optimizer, the loader, a process group the
  user made, any import after steadytrain's);
- ``group_s``: rendezvous and process-group init inside Run: ``init_process_group`` when Run
  makes the group, and the first collective (the attempt id's broadcast), which waits for the
  slowest rank to arrive;
- ``setup_s``: Run's own set-up besides (the run lease, the meter opening the ledger, the
  checkpointer, the run identity): what is left of the start-up, so the phases add up to
  ``startup_s`` exactly;
- ``restore_s`` stays the ``job_start`` field it always was.

``job_start.startup_phases`` holds the first four; the report adds the first step's excess
over a steady step from the step records (report/restarts.py). docs/format.md part B.
"""

from __future__ import annotations

import time

__all__ = ["STARTUP_PHASES", "StartupClock"]

# The keys of ``job_start.startup_phases``, in the order they happen.
STARTUP_PHASES = ("imports_s", "build_s", "group_s", "setup_s")


class StartupClock:
    """Accumulates the ``group_s`` intervals of ``Run._start``; ``phases(startup_s)`` splits
    the attempt's start-up (birth -> ``job_start``, less the restore) into the four phases."""

    def __init__(self, born: float, imported: float) -> None:
        self.born, self.imported = born, imported
        self.entered = time.time()
        self.group_s = 0.0
        self._t: float | None = None

    def group_begin(self) -> None:
        self._t = time.perf_counter()

    def group_end(self) -> None:
        if self._t is not None:
            self.group_s += time.perf_counter() - self._t
            self._t = None

    def phases(self, startup_s: float) -> dict[str, float]:
        """The four phases, each >= 0, adding up to ``startup_s``: imports and build are
        clamped into it (a clock that stepped), set-up is what is left."""
        left = max(0.0, float(startup_s))
        out = {}
        for name, seconds in (
            ("imports_s", self.imported - self.born),
            ("build_s", self.entered - max(self.imported, self.born)),
            ("group_s", self.group_s),
        ):
            out[name] = min(left, max(0.0, seconds))
            left -= out[name]
        out["setup_s"] = left
        return out
