"""The ``slowdown`` badput bucket: productive time a background checkpoint write cost the
steps that ran wholly beside it (issue 13). ``goodput.GoodputAccumulator`` owns the ledger
arithmetic and feeds this tracker the step and checkpoint records; the tracker says how much
of the steps' productive time to move into ``slowdown`` when a write ends.

A write opens at the step whose record has a checkpoint block (the save started there, at
the record's ``t - checkpoint_block_s``). Its ``checkpoint`` record, ok or not, comes some
steps later, delivered by the loop at the first step that finds the write finished, before
that step's own record. Its excess is ``max(0, productive sum of the steps beside it - n x
baseline)``, where the steps beside it are:

- every step that ran wholly beside the write, counted whole;
- the step that found it finished, counted pro rata: the share of that step's wall time
  before the write ended (the save's start plus the record's ``durable_s``). A write shorter
  than a step has only this step beside it: counting it whole would charge a write that
  ended at its start, leaving it out made such writes invisible (issue 13: 10 MB writes of
  ~60 ms beside 35 ms steps booked 0). A record without ``durable_s`` (older ledgers) leaves
  it out, as before.

The baseline is the median productive time of the attempt's latest ``BASELINE_STEPS`` steps
outside writes. Left out of it: an attempt's first step (compile, cold allocator and caches)
and the step that found a write finished. While the attempt has no baseline yet, the
previous attempt's is used; steps wholly beside a write with no baseline at all are counted
as unmeasured (the bucket reads 0 there because it could not be measured).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["BASELINE_STEPS", "SlowdownTracker"]

# Steps outside writes whose median is an attempt's baseline productive step time: enough
# for a stable median, few enough to follow a run whose step time drifts.
BASELINE_STEPS = 33


class SlowdownTracker:
    """The open background write and the baselines it is measured against."""

    def __init__(self) -> None:
        # The open background write [step, productive sum, steps] (None: none open), the
        # attempt's latest steps outside writes, the last non-empty such list of an earlier
        # attempt (the fallback, see baseline_s), whether the next step record is the one
        # that found a write finished or the attempt's first, and the steps beside a write
        # with no baseline.
        self.write: list[Any] | None = None  # [step, sum, steps, save start t (or None)]
        self.end_t: float | None = None  # the open write's end, once its record came
        self.baseline: list[float] = []
        self.carried: list[float] = []
        self.partial = False
        self.unmeasured = 0
        self.last_ckpt_record = -1  # step of the newest checkpoint record, ok or not

    def attempt_started(self) -> None:
        """A new attempt (after ``write_ended(None)`` closed its predecessor's write)."""
        if self.baseline:  # the fallback while the new attempt has no baseline yet
            self.carried = self.baseline
        # Each attempt has its own baseline, and its first step is no sample of it: it pays
        # one-time costs (compile, cold allocator and caches) that later steps do not.
        self.baseline, self.partial = [], True

    def step(
        self,
        step: int,
        productive_s: float,
        checkpoint_block_s: float,
        t: float | None = None,
        step_s: float = 0.0,
    ) -> float:
        """One step record (``t``: when it was written, ``step_s``: its wall time): a sample
        of the baseline, a step beside the open write, or the step that found it finished.
        Returns the excess of a write this step closed (0 when none)."""
        excess = 0.0
        if self.write is not None and self.end_t is not None:  # it found the write finished
            share = 0.0
            if t is not None and step_s:
                share = min(1.0, max(0.0, (self.end_t - (t - step_s)) / step_s))
            self.write[1] += share * productive_s
            self.write[2] += share
            excess = self._close()
            self.partial = False  # this step was the partial one
        elif self.write is not None:  # ran wholly beside a background write
            self.write[1] += productive_s
            self.write[2] += 1
            if not (self.baseline or self.carried):
                self.unmeasured += 1  # nothing to compare it with: excess() books 0
        elif self.partial:
            self.partial = False
        else:
            self.baseline = (self.baseline + [productive_s])[-BASELINE_STEPS:]
        if self.write is None and checkpoint_block_s > 0 and step != self.last_ckpt_record:
            start = None if t is None else t - checkpoint_block_s
            self.write = [step, 0.0, 0, start]  # its save started here; its record comes later
        return excess

    def baseline_s(self) -> float | None:
        """The baseline productive step time: the median of the attempt's own steps outside
        writes, or, while it has none, of the last earlier attempt that had some (None: no
        attempt had any).

        The fallback exists because saves can be in flight at every step of an attempt
        (frequent saves whose writes span several steps, the first one started by the
        attempt's first step): without it the slowed compute would be booked as productive.
        It is sound enough because it is the same job training the same model with the same
        batch size, so a step costs about the same. It is not exact: a restart may land on
        other machines, and under elastic training the world size may change (and with it
        the per-rank step time), so the attempt's own baseline replaces it as soon as the
        attempt has one clean step."""
        base = self.baseline or self.carried
        return statistics.median(base) if base else None

    def excess(self) -> float:
        """The open write's slowdown so far; 0 without a write or a baseline."""
        if self.write is None:
            return 0.0
        median = self.baseline_s()
        return 0.0 if median is None else max(0.0, self.write[1] - self.write[2] * median)

    def write_ended(self, step: int | None, durable_s: float | None = None) -> float:
        """A ``checkpoint`` record of ``step`` (or, ``None``, the end of the attempt) ends
        the open write. With the write's start and ``durable_s`` known, the next step (the
        one that found it finished) still counts pro rata and closes it; otherwise it closes
        now. Returns the excess of a write closed here: the productive time to move into
        ``slowdown`` (0 when none)."""
        if step is not None:
            self.last_ckpt_record = step
        # One save is in flight at a time: a record of a later step ends this write too.
        if self.write is None or (step is not None and step < self.write[0]):
            return 0.0
        if step is not None and durable_s is not None and self.write[3] is not None:
            self.end_t = self.write[3] + float(durable_s)
            return 0.0
        excess = self._close()
        self.partial = step is not None
        return excess

    def _close(self) -> float:
        excess = self.excess()
        self.write, self.end_t = None, None
        return excess

    # The keys are the goodput state's (version 2 and 3), flat in it.
    def state_dict(self) -> dict[str, Any]:
        return {
            "write": None if self.write is None else list(self.write),
            "write_end_t": self.end_t,
            "baseline": list(self.baseline),
            "carried_baseline": list(self.carried),
            "unmeasured": self.unmeasured,
            "partial": self.partial,
            "last_ckpt_record": self.last_ckpt_record,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Version 2 lacks the carried baseline and the unmeasured count: both load empty.
        An older version 3 lacks the write's start and end: its open write is closed the
        old way (the step that finds it finished left out)."""
        w = sd["write"]
        start = None if w is None or len(w) < 4 or w[3] is None else float(w[3])
        self.write = None if w is None else [int(w[0]), float(w[1]), float(w[2]), start]
        end = sd.get("write_end_t")
        self.end_t = None if end is None else float(end)
        self.baseline = [float(v) for v in sd["baseline"]]
        self.carried = [float(v) for v in sd.get("carried_baseline", [])]
        self.unmeasured = int(sd.get("unmeasured", 0))
        self.partial = bool(sd["partial"])
        self.last_ckpt_record = int(sd["last_ckpt_record"])
