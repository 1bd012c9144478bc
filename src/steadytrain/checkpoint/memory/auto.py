"""``every_steps = "auto"``: the job measures its snapshots, then the planner picks K.

A snapshot costs the loop more than the seconds it blocks: while its generation is written
and sent in the background, that work takes cores (and memory bandwidth) from the training
step, which on a host with no idle core slows every step it overlaps. So the job measures
the whole cost, in its steady state: the first ``WARM`` steps it runs (after a restore too)
are snapshotted and not measured (they allocate the staging buffers and the files every
later generation reuses: a first generation costs several times a later one). The next
step is the measured snapshot, then ``GAP`` steps run without one, timed at each ``due``
call, and the step after them is snapshotted again. Steps that began after the measured
generation landed are the clean step time; the steps it overlapped, less its blocking (net
of waiting for the warm-up generation) and less as many clean steps, are its
interference. The snapshot's cost is its blocking plus that interference.

The last measuring generation's agreement (the all-gather every generation does on the tier's
group) carries, from every rank, the clean step time, the cost, and the time the first
generation took to land (write and peer copy). Every rank takes the worst of each and the
same ``planning.two_tier.memory_every_steps`` answer, so all ranks snapshot at the same
steps: a rank that disagreed would leave its peer waiting in the next exchange. The
measuring steps are fixed by step number, so every rank takes them together. Until the
answer is known, ``due`` waits for that generation (once per run, counted as blocking).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["AutoInterval", "GAP", "WARM"]

WARM = 2  # snapshots taken first and not measured: the two files a tier keeps are made
GAP = 4  # steps between the measured snapshot and the one that carries the measurement


class AutoInterval:
    """The interval of a tier configured with ``every_steps = "auto"``."""

    def __init__(self, mtbf_s: float, survives: float) -> None:
        self.mtbf_s, self.survives = mtbf_s, survives
        self.every: int | None = None  # chosen K (None: still measuring)
        self._first: int | None = None  # the step of the first (warm-up) snapshot
        self._taken = 0  # measuring snapshots started (warm-up ones included)
        self._landed = 0  # measuring generations landed
        self._t_first = 0.0  # perf_counter at the measured one's start
        self._block = 0.0  # the larger blocking of the measured snapshots
        self._ticks: list[tuple[float, int, bool]] = []  # (time, step, landed) at due()
        self.step_s = 0.0  # clean seconds per step
        self.cost_s = 0.0  # blocking + interference of one snapshot
        self.landed_s = 0.0  # the first generation's write + peer time
        self.chosen_from: dict[str, float] = {}  # the agreed numbers K was chosen from

    def due(self, step: int, landed: bool) -> bool | None:
        """While measuring: whether ``step`` is snapshotted (``landed``: the measured
        generation is written by now); None once the measuring snapshots are taken."""
        if self.every is not None or self._taken >= WARM + 2:
            return None
        if self._first is None:
            self._first = step
        offset = step - self._first
        if self._taken == WARM + 1 and offset > WARM:
            self._ticks.append((time.perf_counter(), step, landed))
        return offset <= WARM or offset >= WARM + GAP

    def started(self, t0: float, block_s: float) -> dict[str, Any] | None:
        """A snapshot started at ``t0`` blocked ``block_s`` (net of waiting for the previous
        generation); returns this rank's measurement once it is complete (to go into that
        generation's agreement)."""
        if self.every is not None:
            return None
        self._taken += 1
        if self._taken <= WARM:
            return None
        self._block = max(self._block, block_s)
        if self._taken == WARM + 1:
            self._t_first = t0
            return None
        self.step_s, interference = self._steps()
        self.cost_s = self._block + interference
        return {"step_s": self.step_s, "block_s": self.cost_s, "interference_s": interference}

    def _steps(self) -> tuple[float, float]:
        """(clean seconds per step, the first generation's interference) from the ticks."""
        clean, overlapped, steps_overlapped = [], 0.0, 0
        t_prev, s_prev, free = self._t_first, (self._first or 0) + WARM, False
        for t, s, landed in self._ticks:
            n = max(1, s - s_prev)
            if free:
                clean.append((t - t_prev) / n)
            else:
                overlapped += t - t_prev
                steps_overlapped += n
            t_prev, s_prev, free = t, s, landed
        if not clean and not steps_overlapped:
            return max(1e-6, t_prev - self._t_first), 0.0
        # no step began after the first generation landed: the overlapped mean stands in
        # (an upper bound of the clean step, so the interference is not overstated)
        step_s = statistics.median(clean) if clean else overlapped / steps_overlapped
        step_s = max(1e-6, step_s)
        # The first interval holds the first snapshot's blocking; the rest is interference.
        interference = max(0.0, overlapped - self._block - steps_overlapped * step_s)
        return step_s, interference

    def landed(self, seconds: float) -> None:
        """A generation landed: its write + peer copy took ``seconds`` (kept for the
        measured one; generations land in the order they started)."""
        if self.every is None:
            self._landed += 1
            if self._landed == WARM + 1:
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
        self.chosen_from = {
            "step_s": max(m["step_s"] for m in got),
            "cost_s": max(m["block_s"] for m in got),
            "interference_s": max(m.get("interference_s", 0.0) for m in got),
            "landed_s": max(m.get("landed_s", 0.0) for m in got),
        }
        return self.every
