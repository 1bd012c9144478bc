"""``every_steps = "auto"``: the job measures its snapshots, then the planner picks K.

The first two steps a job runs (after a restore too) are both snapshotted. The second
generation's agreement (the all-gather every generation does on the tier's group) carries,
from every rank, the loop's time between those two snapshots (one step, with the first
snapshot's blocking in it), the larger blocking of the two, and the time the first took to
land (write and peer copy). Every rank takes the worst of each and the same
``planning.two_tier.memory_every_steps`` answer, so all ranks snapshot at the same steps: a
rank that disagreed would leave its peer waiting in the next exchange. Until the answer is
known, ``due`` waits for that generation (once per run, counted as blocking).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AutoInterval"]

MEASURED = 2  # snapshots taken before K is chosen


class AutoInterval:
    """The interval of a tier configured with ``every_steps = "auto"``."""

    def __init__(self, mtbf_s: float, survives: float) -> None:
        self.mtbf_s, self.survives = mtbf_s, survives
        self.every: int | None = None  # chosen K (None: still measuring)
        self._taken = 0  # snapshots started while measuring
        self._t_first = 0.0  # perf_counter at the first one's start
        self._block = 0.0  # the larger blocking of the measured snapshots
        self.step_s = 0.0
        self.landed_s = 0.0  # the first generation's write + peer time

    def measuring(self) -> bool:
        return self.every is None and self._taken < MEASURED

    def started(self, t0: float, block_s: float) -> dict[str, Any] | None:
        """A snapshot started at ``t0`` blocked ``block_s``; returns this rank's measurement
        once it is complete (to go into that generation's agreement)."""
        if self.every is not None:
            return None
        self._taken += 1
        self._block = max(self._block, block_s)
        if self._taken == 1:
            self._t_first = t0
            return None
        self.step_s = max(1e-6, t0 - self._t_first)
        return {"step_s": self.step_s, "block_s": self._block}

    def landed(self, seconds: float) -> None:
        """The first measured generation's write + peer copy took ``seconds``."""
        if self.every is None and self.landed_s == 0.0:
            self.landed_s = seconds

    def choose(self, measured: list[dict[str, Any] | None]) -> int:
        """Every rank's measurement (from the agreement) -> the same K on every rank."""
        from steadytrain.planning.two_tier import memory_every_steps

        got = [m for m in measured if m]
        if not got:
            self.every = 1
            return 1
        self.every = memory_every_steps(
            step_s=max(m["step_s"] for m in got),
            cost_s=max(m["block_s"] for m in got),
            landed_s=max(m.get("landed_s", 0.0) for m in got),
            mtbf_s=self.mtbf_s,
            survives=self.survives,
        )
        return self.every
