"""The ``slowdown`` badput bucket: productive time a background checkpoint write cost the
steps that ran wholly beside it (issue 13). ``goodput.GoodputAccumulator`` owns the ledger
arithmetic and feeds this tracker the step and checkpoint records; the tracker says how much
of the steps' productive time to move into ``slowdown`` when a write ends.

A write opens at the step whose record has a checkpoint block (the save started there; its
``checkpoint`` record, ok or not, comes some steps later and closes it). Its excess is
``max(0, productive sum of the steps beside it - n x baseline)``; the baseline is the median
productive time of the attempt's latest ``BASELINE_STEPS`` steps outside writes. Left out of
the baseline: an attempt's first step (compile, cold allocator and caches) and the step that
found a write finished (it overlapped the write partly). While the attempt has no baseline
yet, the previous attempt's is used; steps beside a write with no baseline at all are
counted as unmeasured (the bucket reads 0 there because it could not be measured).
"""

from __future__ import annotations

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
        self.write: list[Any] | None = None
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

    def step(self, step: int, productive_s: float, checkpoint_block_s: float) -> None:
        """One step record: a sample of the baseline, or a step beside the open write."""
        if self.write is not None:  # ran wholly beside a background write
            self.write[1] += productive_s
            self.write[2] += 1
            if not (self.baseline or self.carried):
                self.unmeasured += 1  # nothing to compare it with: excess() books 0
        elif self.partial:
            self.partial = False
        else:
            self.baseline = (self.baseline + [productive_s])[-BASELINE_STEPS:]
        if self.write is None and checkpoint_block_s > 0 and step != self.last_ckpt_record:
            self.write = [step, 0.0, 0]  # its save started here; its record comes later

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
        base = sorted(self.baseline or self.carried)
        if not base:
            return None
        mid = len(base) // 2
        return base[mid] if len(base) % 2 else (base[mid - 1] + base[mid]) / 2

    def excess(self) -> float:
        """The open write's slowdown so far; 0 without a write or a baseline."""
        if self.write is None:
            return 0.0
        median = self.baseline_s()
        return 0.0 if median is None else max(0.0, self.write[1] - self.write[2] * median)

    def write_ended(self, step: int | None) -> float:
        """A ``checkpoint`` record of ``step`` (or, ``None``, the end of the attempt) closes
        the open write. Returns its excess: the productive time to move into ``slowdown``
        (0 when no write was open)."""
        if step is not None:
            self.last_ckpt_record = step
        # One save is in flight at a time: a record of a later step ends this write too.
        if self.write is None or (step is not None and step < self.write[0]):
            return 0.0
        excess = self.excess()
        self.write = None
        self.partial = step is not None
        return excess

    # The keys are the goodput state's (version 2 and 3), flat in it.
    def state_dict(self) -> dict[str, Any]:
        return {
            "write": None if self.write is None else list(self.write),
            "baseline": list(self.baseline),
            "carried_baseline": list(self.carried),
            "unmeasured": self.unmeasured,
            "partial": self.partial,
            "last_ckpt_record": self.last_ckpt_record,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Version 2 lacks the carried baseline and the unmeasured count: both load empty."""
        w = sd["write"]
        self.write = None if w is None else [int(w[0]), float(w[1]), int(w[2])]
        self.baseline = [float(v) for v in sd["baseline"]]
        self.carried = [float(v) for v in sd.get("carried_baseline", [])]
        self.unmeasured = int(sd.get("unmeasured", 0))
        self.partial = bool(sd["partial"])
        self.last_ckpt_record = int(sd["last_ckpt_record"])
