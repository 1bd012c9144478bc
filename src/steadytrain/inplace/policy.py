"""Which deaths of a rank's training process the keeper recovers in place (pure).

A death by a signal (SIGKILL from the OOM killer or an operator, a SIGSEGV or SIGBUS in a
native library, an abort) is a fault of that process: the replaced process redoes the same
steps on the same state, and nothing says the fault comes back. An exit with a status is
the script's own verdict (a Python exception, ``sys.exit(3)``, a failed regroup asking for
the whole restart): replaying it would most likely replay the cause, so torchrun's whole
restart decides. A fault is also left to the whole restart when

- the process never completed a step since it started (a replacement that cannot even
  rejoin and train one step is a fault repeating, not a passing one; a first process that
  dies during start-up is not a mid-run fault);
- this rank already recovered ``max_recoveries`` times in this torchrun attempt.

Doubt goes to the whole restart: it is slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import signal

__all__ = ["IN_PLACE_SIGNALS", "Death", "Policy"]

IN_PLACE_SIGNALS = frozenset(
    {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL}
)


@dataclasses.dataclass(frozen=True)
class Death:
    """How one training process ended: ``code`` as ``subprocess`` gives it (negative: the
    signal) and whether it had completed a step since it started."""

    code: int
    stepped: bool

    def describe(self) -> str:
        if self.code < 0:
            return f"killed by {signal.Signals(-self.code).name}"
        return f"exited with status {self.code}"


@dataclasses.dataclass(frozen=True)
class Policy:
    max_recoveries: int = 3

    def __post_init__(self) -> None:
        if self.max_recoveries < 0:
            raise ValueError(
                f"max_recoveries must be >= 0 (0 turns in-place recovery off), not "
                f"{self.max_recoveries}"
            )

    def verdict(self, death: Death, recovered: int) -> str | None:
        """None when ``death`` is recovered in place (``recovered`` in-place recoveries
        already done), else why torchrun's whole restart takes over."""
        if death.code >= 0:
            return f"the training process {death.describe()} (its own verdict, not a fault)"
        if -death.code not in IN_PLACE_SIGNALS:
            return f"the training process was {death.describe()}, not a process fault"
        if not death.stepped:
            return (
                f"the training process was {death.describe()} before it completed a step "
                "(a fault repeating, or one during start-up)"
            )
        if recovered >= self.max_recoveries:
            return f"{recovered} in-place recoveries already (max_recoveries)"
        return None
