"""``WatchdogConfig``: the hang watchdog's deadlines (``[monitor.watchdog]``) and their check.

Apart from the watchdog's machinery (watchdog.py) so the meter's and the training config
share one definition. Deadlines are seconds without progress:

- ``init``: until ``warmup_steps`` steps of this attempt are done: ``max(init_s, step)``;
- ``step``: ``max(k x p99 step time, floor_s)``;
- a declared phase (``with run.phase(name)``): ``max(phases["<name>_s"], step)``, and for a
  name with no deadline of its own (``eval``, the user's own names) ``checkpoint_s``: a phase
  is declared because it is legitimately long, so it never falls back to the step deadline.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from steadytrain.settings import InvalidSetting, check

__all__ = ["IMPLICIT_PHASES", "WatchdogConfig", "backend_timeout_s", "check_phase_name", "p99"]

# The watchdog's own names for the time outside any declared phase: not declarable.
IMPLICIT_PHASES = ("init", "step")


def check_phase_name(name: Any) -> None:
    """Raise ``ValueError`` unless ``name`` can be declared (``with run.phase(name)``): an
    identifier, so that its deadline can be set as ``phases.<name>_s``."""
    if not isinstance(name, str) or not name.isidentifier() or name in IMPLICIT_PHASES:
        raise ValueError(
            f"watchdog phase {name!r}: use a name that is a Python identifier (e.g. 'eval', "
            f"'checkpoint', 'export'), not {' or '.join(map(repr, IMPLICIT_PHASES))}: its "
            "deadline is then monitor.watchdog.phases.<name>_s (default checkpoint_s)"
        )


@dataclasses.dataclass(kw_only=True)
class WatchdogConfig:
    """The watchdog's deadlines (``[monitor.watchdog]``). Defaults follow the anchors: 60 s
    floor (NVRx in-process soft timeout), torchtitan's 300 s for start-up, NVRx's long
    checkpoint section; all below NCCL's 10 min so the watchdog, which can dump and kill,
    fires before a backend that cannot abort a pending gloo collective."""

    enabled: bool = True
    k: float = 8.0  # step deadline = max(k x p99 step time, floor_s); NVRx uses 5 x max
    floor_s: float = 60.0  # never less than this after warm-up (GC pauses, slow saves)
    warmup_steps: int = 5  # steps of each attempt under init_s (compile, cache fill)
    init_s: float = 300.0  # from the watchdog's start until warmup_steps steps are done
    checkpoint_s: float = 480.0  # inside a checkpoint phase, and any phase without its own
    # Declared phases' own deadlines by "<name>_s" ([monitor.watchdog.phases] eval_s = 900);
    # a name not given here (eval included) gets checkpoint_s. The checkpoint phase's is
    # checkpoint_s itself: one key for one deadline, so phases.checkpoint_s is refused.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    window: int = 200  # recent step times the p99 is taken over
    poll_s: float = 1.0  # how often the daemon thread looks; adds to detection time
    grace_s: float = 10.0  # bounded waits for the other ranks' verdicts and the record
    # A child process per rank (reaper.py) that SIGKILLs the rank once a hang is decided
    # and the rank cannot exit itself (SIGSTOPped, its watchdog thread unable to run).
    reaper: bool = True

    def __post_init__(self) -> None:
        check(self.k >= 1, "k", self.k, "use 1 or more (a multiple of the p99 step time)")
        for key in ("floor_s", "init_s", "checkpoint_s", "poll_s"):
            check(getattr(self, key) > 0, key, getattr(self, key), "use a positive number")
        check(self.grace_s >= 0, "grace_s", self.grace_s, "use 0 or more seconds")
        check(self.warmup_steps >= 1, "warmup_steps", self.warmup_steps, "use 1 or more")
        check(self.window >= 10, "window", self.window, "use at least 10 step times")
        check(
            self.poll_s <= self.floor_s / 2,
            "poll_s",
            self.poll_s,
            f"use at most floor_s / 2 ({self.floor_s / 2:g}); it adds to detection time",
        )
        check(
            isinstance(self.phases, dict),
            "phases",
            self.phases,
            'give a table of "<name>_s" = seconds, e.g. {eval_s = 900}',
        )
        self.phases = {key: self._phase_entry(key, v) for key, v in self.phases.items()}

    @staticmethod
    def _phase_entry(key: Any, value: Any) -> float:
        where = f"phases.{key}"
        name = key[:-2] if isinstance(key, str) and key.endswith("_s") else None
        if name is None or not name.isidentifier() or name in IMPLICIT_PHASES:
            raise InvalidSetting(
                where,
                value,
                "name a declared phase with a _s suffix, e.g. phases.eval_s = 900 (init and "
                "step are the watchdog's own: init_s, floor_s)",
            )
        if name == "checkpoint":
            raise InvalidSetting(where, value, "set checkpoint_s instead (one key per deadline)")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(ok and math.isfinite(value) and value > 0, where, value, "use positive seconds")
        return float(value)

    def phase_s(self, name: str) -> float:
        """A declared phase's own deadline: ``phases["<name>_s"]``, else ``checkpoint_s``."""
        return self.phases.get(f"{name}_s", self.checkpoint_s)

    def deadline(self, phase: str, p99_s: float | None) -> float:
        """Seconds without progress that count as a hang in ``phase`` given the p99 step."""
        step = max(self.k * p99_s, self.floor_s) if p99_s else self.floor_s
        if phase == "step":
            return step
        if phase == "init":
            return max(self.init_s, step)
        return max(self.phase_s(phase), step)

    @property
    def longest_static_s(self) -> float:
        return max(self.init_s, self.checkpoint_s, self.floor_s, *self.phases.values())


def p99(samples: list[float]) -> float | None:
    """The 99th percentile (nearest rank) of ``samples``; None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def backend_timeout_s(backend: str) -> float:
    """The collective timeout torch uses for ``backend`` when none is passed to
    ``init_process_group`` (torch.distributed.constants; NCCL: 10 min when not built in)."""
    from torch.distributed import constants

    if "nccl" in backend.lower():
        t = getattr(constants, "default_pg_nccl_timeout", None)
        return t.total_seconds() if t is not None else 600.0
    return constants.default_pg_timeout.total_seconds()
