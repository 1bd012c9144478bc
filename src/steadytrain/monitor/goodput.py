"""Goodput arithmetic: where every second of a run went. The ONE place it is computed.

Definitions follow the buckets of Google's ml-goodput-measurement
(https://github.com/AI-Hypercomputer/ml-goodput-measurement, ``goodput_utils.BadputType``:
PROGRAM_STARTUP, TRAINING_PREP, DATA_LOADING, UNPRODUCTIVE_CHECKPOINT_SAVE_TIME,
UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME, WASTED_PROGRESS_FROM_DISRUPTION, CUSTOM_BADPUT_EVENTS,
OTHER), where
"goodput is the share of wall-clock time spent on preserved, productive work: training
steps that completed and were not lost to a restart or rollback".

Over the whole job (every attempt in the ledger):

* ``total_s`` = end - start, where start is the first attempt's process start
  (``job_start.t - startup_s - restore_s``) and end is the last record (or ``now``).
* productive time of a step = ``compute_s`` (forward, backward, optimizer), capped at
  ``step_s - data_wait_s - checkpoint_block_s - eval_s``; if a record has no ``compute_s``,
  that cap.
* ``goodput_s`` = productive time of the steps that were **kept**. A step ``s`` recorded by
  attempt ``a`` is superseded when a later attempt restores a step ``< s`` and redoes it.
* badput buckets (seconds; they and ``goodput_s`` sum to ``total_s``):

  - ``startup``: ``job_start.startup_s`` (process start, imports, model build, compile),
    plus what the attempt's first step record holds beyond its data wait, checkpoint block
    and productive time: the set-up between ``job_start`` and the loop's first step (the
    meter's sinks opening, the watchdog, the loop's own preparation, the other ranks
    still starting), which is start-up, not ``other`` (issue 42);
  - ``restore``: ``job_start.restore_s`` (loading the checkpoint);
  - ``data_wait``: ``data_wait_s`` of every step record (time blocked in ``next()``);
  - ``checkpoint_block``: ``checkpoint_block_s`` of every step record (the part of a save
    the loop waited for) and of a ``job_end`` (the closing wait for the final save and
    the one in flight); the background part of an async save is charged under
    ``slowdown`` when it slows the steps that run beside it;
  - ``eval``: ``eval_s`` of every step record (time inside the declared ``eval`` phase since
    the previous step: ``with run.phase("eval")``, the trainer callbacks' evaluations) and of
    a ``job_end`` (an evaluation after the last step). Badput,
    as Google's library books an evaluation (a ``CUSTOM_BADPUT_EVENTS`` entry such as
    ``EVAL_STEP``): it does not advance the model, so it is not goodput; it is a bucket of its
    own so that it is never read as data wait or checkpoint time (issue 42);
  - ``slowdown``: productive time a background checkpoint write cost the steps beside it
    (the one that found it finished pro rata): ``max(0, their productive sum - n x
    baseline)`` per write, against the attempt's baseline step (``monitor/slowdown.py``
    says which steps make it). It leaves productive time: slowed compute is not booked as
    work (docs/monitoring.md, issue 13).
    Steps beside a write with no baseline at all are counted in
    ``Breakdown.slowdown_unmeasured_steps`` (unmeasured, not free);
  - ``lost_to_failures``: productive time of superseded steps (the work redone after a
    resume: steps after the checkpoint that the next attempt restored);
  - ``restart_gap``: wall time from the last progress of an attempt (its newest ``step``
    or ``ok`` ``checkpoint`` record, or its ``job_start`` before any; plus the ``eval_s``
    and ``checkpoint_block_s`` of its ``job_end``) to the process start of the next one: failure detection (the step the
    fault cut short, a survivor blocked in a collective until the peer's socket closed, the
    crash's ``job_end``), rescheduling, queueing. The window ``report/restarts.py`` splits
    into phases, so the two views agree; a ``hang`` record never moves the gap's start, so
    the time the watchdog took to detect the hang is charged here too;
  - ``other``: the rest (loop overhead between ``next()`` and the step, logging, the tail
    after the last step).

Waits of superseded steps stay in their own buckets: they were waits either way.
``recovery_point_age_s`` = end - time of the newest committed (``ok``) checkpoint (end -
start when none): the work a failure at ``end`` would throw away.

Restores reconcile the checkpoints (issue 42): a restored step is a recovery point whatever
the ledger holds of it, so a second restore of the same step (a restart loop) keeps the
steps up to it; and a durable ``restore`` of a step newer than every commit the ledger
recorded proves that commit (an attempt killed right after COMMIT, before its ``checkpoint``
record reached the ledger): it is counted in ``checkpoints`` (and
``checkpoints_reconciled``) and dated by the restore's ``commit_t`` (the COMMIT's time),
else by the restoring attempt's process start, the latest it can have been.

Streaming: ``GoodputAccumulator`` consumes records one at a time in O(1) memory per step
(it remembers the cumulative kept time at each committed checkpoint and the steps since the
last one), so the live meter and the offline report share this code.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from steadytrain.monitor.slowdown import SlowdownTracker

__all__ = [
    "BUCKETS",
    "Breakdown",
    "GoodputAccumulator",
    "compute_goodput",
    "data_stall_share",
    "productive_s",
]

BUCKETS = (
    "startup",
    "restore",
    "data_wait",
    "checkpoint_block",
    "eval",
    "slowdown",
    "lost_to_failures",
    "restart_gap",
    "other",
)

# Committed checkpoints remembered for rollback arithmetic (the newest K). The ledger does
# not know the checkpointer's retention (``keep_every`` can keep any number), so the bound
# is a fixed K: a restore to a checkpoint older than the K newest commits is charged from
# the nearest remembered one at or before it (or from step 0), over-counting
# ``lost_to_failures``. The live meter, its restart snapshot and the offline report all use
# the same K, so they always agree.
_MAX_CHECKPOINTS = 64
# 2: the slowdown bucket and its write/baseline state; 3: the carried baseline and the
# unmeasured count (a version-2 state loads with both empty).
STATE_VERSION = 3
_LOADABLE_VERSIONS = (2, 3)
# Buckets added since a loadable version: an older state has none of their seconds (its
# records had no such field), so they load as 0 rather than forcing a full replay.
_ADDED_BUCKETS = ("eval",)


def _sec(v: Any) -> float:
    """A duration field as seconds: anything but a finite number >= 0 counts as 0. The file
    readers already skip such records (monitor/records.py); this keeps a record handed to
    the live meter by a caller from making a bucket negative or infinite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    f = float(v) if -1e300 < v < 1e300 else math.inf
    return f if 0.0 <= f < math.inf else 0.0


def _int(v: Any, default: int = 0) -> int:
    """A step, attempt or token count: ``default`` unless a finite number >= 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    if isinstance(v, float) and not math.isfinite(v):
        return default
    return int(v) if v >= 0 else default


def productive_s(rec: dict[str, Any]) -> float:
    """Productive seconds of one step record (see module docstring)."""
    step_s = _sec(rec.get("step_s"))
    waits = _sec(rec.get("data_wait_s")) + _sec(rec.get("checkpoint_block_s"))
    waits += _sec(rec.get("eval_s"))
    cap = max(0.0, step_s - waits)
    compute = rec.get("compute_s")
    if compute is None:
        return cap
    return min(_sec(compute), cap)


@dataclass
class Breakdown:
    total_s: float
    goodput_s: float
    badput_s: dict[str, float]
    attempts: int
    steps_recorded: int
    steps_kept: int
    steps_lost: int
    tokens_kept: int
    last_step: int
    recovery_point_age_s: float | None
    attempt_summaries: list[dict[str, Any]] = field(default_factory=list)
    # Steps that ran beside a background write while no baseline existed (neither the
    # attempt's own nor one carried from an earlier attempt): their slowdown is unmeasured.
    slowdown_unmeasured_steps: int = 0
    # Seconds the records claimed beyond the wall time (durations that cannot all have
    # happened between the first and last timestamps): the figures were scaled to fit.
    overbooked_s: float = 0.0
    # Charges ``charged`` could not make in full (what they were to take out of goodput or
    # a bucket exceeded what it held): {bucket: {"measured_s", "charged_s", "source"}}.
    capped: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Committed checkpoints: ``ok`` checkpoint records, plus those only a restore proves
    # (``checkpoints_reconciled``: the ledger lost their records; module docstring).
    checkpoints: int = 0
    checkpoints_reconciled: int = 0

    @property
    def goodput(self) -> float:
        return self.goodput_s / self.total_s if self.total_s > 0 else 0.0

    def badput_fraction(self) -> dict[str, float]:
        t = self.total_s
        return {k: (v / t if t > 0 else 0.0) for k, v in self.badput_s.items()}

    def shares(self) -> dict[str, float]:
        """``goodput`` then every bucket, in order, as shares of ``total_s``: what the
        report's heading, table, goodput bar and JSON all print (they sum to 1)."""
        return {"goodput": self.goodput, **self.badput_fraction()}

    def charged(self, bucket: str, seconds: float, source: str = "goodput") -> Breakdown:
        """A copy with ``seconds`` (capped at what ``source`` holds) moved from ``source``
        (``"goodput"`` or a bucket, e.g. ``"other"``) into ``bucket``, appended after the
        others. The report charges what rank 0's ledger cannot see this way
        (``straggler_wait``, ``records_lost``), so every view prints one breakdown that
        still sums to ``total_s``. A charge larger than ``source`` holds is capped, and
        the copy's ``capped`` says so: the measured and the charged seconds (a goodput of
        0.0 % from a capped charge is not left unexplained)."""
        bad = dict(self.badput_s)
        good = self.goodput_s
        held = good if source == "goodput" else bad.get(source, 0.0)
        asked = max(0.0, _sec(seconds))
        move = min(asked, held)
        if source == "goodput":
            good -= move
        else:
            bad[source] = held - move
        bad[bucket] = bad.get(bucket, 0.0) + move
        capped = dict(self.capped)
        if asked - move > 1e-9 * max(1.0, asked):
            was = capped.get(bucket, {"measured_s": 0.0, "charged_s": 0.0})
            capped[bucket] = {"measured_s": was["measured_s"] + asked,
                              "charged_s": was["charged_s"] + move, "source": source}  # fmt: skip
        return replace(self, goodput_s=good, badput_s=bad, capped=capped)

    def to_dict(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "goodput_s": self.goodput_s,
            "total_s": self.total_s,
            "badput_s": dict(self.badput_s),
            "badput": self.badput_fraction(),
            "attempts": self.attempts,
            "restarts": max(0, self.attempts - 1),
            "steps_recorded": self.steps_recorded,
            "steps_kept": self.steps_kept,
            "steps_lost": self.steps_lost,
            "tokens_kept": self.tokens_kept,
            "last_step": self.last_step,
            "recovery_point_age_s": self.recovery_point_age_s,
            "attempt_summaries": list(self.attempt_summaries),
            "slowdown_unmeasured_steps": self.slowdown_unmeasured_steps,
            "overbooked_s": self.overbooked_s,
            "capped": {k: dict(v) for k, v in self.capped.items()},
            "checkpoints": self.checkpoints,
            "checkpoints_reconciled": self.checkpoints_reconciled,
        }


class GoodputAccumulator:
    """Feed ledger records in order with :meth:`add`; read totals with :meth:`breakdown`."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.last_t: float | None = None
        # The newest progress (module docstring, ``restart_gap``): where a restart's gap
        # starts. Records after it (a crash's job_end, a failed save) claim no time.
        self.progress_t: float | None = None
        self.sums = dict.fromkeys(BUCKETS, 0.0)
        self.productive_all = 0.0
        self.attempts = 0
        self.steps_recorded = 0
        # The live timeline: cumulative kept (productive_s, tokens, steps) up to last_step.
        self.cum = (0.0, 0, 0)
        self.last_step = 0
        self.steps_lost = 0
        self._recent: list[tuple[int, tuple[float, int, int]]] = []  # since last checkpoint
        self._ckpt: OrderedDict[int, tuple[float, int, int]] = OrderedDict()
        # A synchronous save's record comes before its own step's record (the loop saves,
        # then records the step): its kept total is taken when that step arrives.
        self._pending: list[int] = []
        self.last_ckpt_t: float | None = None
        # Committed checkpoints (records, and restores that prove one: ``_restored``), and
        # the newest committed step any record showed.
        self.commits = 0
        self.commits_reconciled = 0
        self.commit_step = 0
        self._attempt: dict[str, Any] | None = None
        self.attempt_summaries: list[dict[str, Any]] = []
        self._slow = SlowdownTracker()  # the slowdown bucket's open write and baselines

    # -- records ---------------------------------------------------------------------------
    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        t = _sec(rec.get("t"))  # a Unix time: finite and >= 0 like a duration
        if kind == "checkpoint":  # ok or not: its background write is over
            durable = rec.get("durable_s")
            durable = None if durable is None else _sec(durable)
            self._book_slowdown(self._slow.write_ended(_int(rec.get("step")), durable))
        if kind == "job_start":
            self._job_start(rec, t)
        elif kind == "step":
            self._step(rec)
        elif kind == "checkpoint" and rec.get("ok", True):
            self._checkpoint(_int(rec.get("step")), t)
        elif kind == "restore":
            self._restored(rec)
        elif kind == "job_end":
            tail = _sec(rec.get("eval_s"))  # an evaluation after the last step
            self.sums["eval"] += tail
            # the closing wait for the final save (and the one in flight): checkpoint time
            block = _sec(rec.get("checkpoint_block_s"))
            self.sums["checkpoint_block"] += block
            if self.progress_t is not None:  # claimed: the gap starts after them
                self.progress_t += tail + block
            if self._attempt is not None:
                self._attempt["reason"] = rec.get("reason", "finished")
        elif kind == "hang":
            # Its attempt ended at the hang's onset (its last step), so the time from there to
            # the next process start is restart_gap: its t (detection) must not move the end.
            # A recovered record arrives in the next attempt: match by attempt number.
            for a in reversed(self.attempt_summaries):
                if a.get("attempt") == rec.get("attempt"):
                    a["reason"] = "hang"
                    break
            return
        if t and self.start is not None:
            self.last_t = t if self.last_t is None else max(self.last_t, t)
            if kind == "step" or (kind == "checkpoint" and rec.get("ok", True)):
                self.progress_t = t if self.progress_t is None else max(self.progress_t, t)
            if self._attempt is not None:
                self._attempt["end_t"] = max(self._attempt["end_t"], t)

    def _job_start(self, rec: dict[str, Any], t: float) -> None:
        startup = _sec(rec.get("startup_s"))
        restore = _sec(rec.get("restore_s"))
        began = t - startup - restore
        if self.start is None:
            self.start = began
        elif self.last_t is not None:
            since = self.last_t if self.progress_t is None else min(self.last_t, self.progress_t)
            self.sums["restart_gap"] += max(0.0, began - since)
        self.progress_t = t if self.start is not None and t else None
        self.sums["startup"] += startup
        self.sums["restore"] += restore
        self.attempts += 1
        # The attempt died mid-write: charge what its steps showed.
        self._book_slowdown(self._slow.write_ended(None))
        self._slow.attempt_started()
        restored = _int(rec.get("restored_step"))
        self._rollback(restored)
        # The restored step is a recovery point whatever the ledger holds of it: a second
        # restore of it (a restart loop) must keep the steps up to it, not fall back to an
        # older commit (issue 42: "1 steps kept, 7 redone" after three restores of step 4).
        # Not so a start whose restore point was unknown (``restore_unknown``): its
        # restored_step is only the ledger's position, and a later attempt may roll back
        # past it to a step the ledger never saw committed (a trainer's own checkpoint).
        real = not rec.get("restore_unknown")
        if real and 0 < restored == self.last_step and restored not in self._ckpt:
            self._commit(restored, self.cum)  # the timeline stands at it now
        self._attempt = {
            "attempt": rec.get("attempt", self.attempts - 1),
            "start_t": began,
            "end_t": t,
            "restored_step": _int(rec.get("restored_step")),
            "first_step": None,
            "last_step": None,
            "steps": 0,
            "reason": "crashed",  # until a job_end says otherwise
        }
        self.attempt_summaries.append(self._attempt)

    def _lookup(self, step: int) -> tuple[float, int, int]:
        for s, cum in reversed(self._recent):
            if s == step:
                return cum
        if step in self._ckpt:
            return self._ckpt[step]
        # Unknown restore point: the nearest committed checkpoint at or before it.
        keys = list(self._ckpt)
        i = bisect.bisect_right(keys, step)
        return self._ckpt[keys[i - 1]] if i else (0.0, 0, 0)

    def _rollback(self, restored: int) -> None:
        if restored >= self.last_step:
            return  # nothing recorded beyond the restore point: nothing redone
        new = self._lookup(restored)
        self.sums["lost_to_failures"] += max(0.0, self.cum[0] - new[0])
        self.steps_lost += max(0, self.cum[2] - new[2])
        self.cum = new
        self.last_step = restored
        self._recent = []
        self._pending = []  # a save of the abandoned timeline whose step never came
        for s in [s for s in self._ckpt if s > restored]:
            del self._ckpt[s]  # checkpoints of the abandoned timeline

    def _restored(self, rec: dict[str, Any]) -> None:
        """A ``restore`` record: a durable restore of a step newer than every commit the
        ledger recorded proves that commit (module docstring); memory-tier restores prove
        no durable commit."""
        step = _int(rec.get("step"))
        if step <= self.commit_step or (rec.get("tier") or "durable") != "durable":
            return
        self.commits += 1
        self.commits_reconciled += 1
        self.commit_step = step
        # its COMMIT's time, else this process's start: it committed before that
        when = _sec(rec.get("commit_t")) or (self._attempt or {}).get("start_t")
        if when:
            self.last_ckpt_t = when if self.last_ckpt_t is None else max(self.last_ckpt_t, when)

    def _step(self, rec: dict[str, Any]) -> None:
        step = _int(rec.get("step"), self.last_step + 1)
        # A recovered summary stands for ``steps`` steps (monitor/recovered.py): steps
        # ``step - n + 1`` .. ``step``, its tokens theirs, its durations 0.
        n = min(max(1, _int(rec.get("steps"), 1)), step) if rec.get("recovered") else 1
        p = productive_s(rec)
        block = _sec(rec.get("checkpoint_block_s"))
        t, step_s = rec.get("t"), _sec(rec.get("step_s"))
        a = self._attempt
        if a is not None and not a["steps"] and not rec.get("recovered"):
            # The attempt's first step: its time beyond data wait, block, evaluation and
            # productive time is the set-up since job_start (module docstring): start-up.
            waits = _sec(rec.get("data_wait_s")) + block + _sec(rec.get("eval_s"))
            self.sums["startup"] += max(0.0, step_s - waits - p)
        # A recovered record's timing is unknown: it is neither a baseline sample nor a
        # measured step beside a write.
        closed = 0.0
        if not rec.get("recovered"):
            closed = self._slow.step(step, p, block, None if t is None else _sec(t), step_s)
        self.productive_all += p
        self.sums["data_wait"] += _sec(rec.get("data_wait_s"))
        self.sums["checkpoint_block"] += block
        self.sums["eval"] += _sec(rec.get("eval_s"))
        self.steps_recorded += n
        c, tokens = self.cum, _int(rec.get("tokens"))
        self.cum = (c[0] + p, c[1] + tokens, c[2] + n)
        # A write this step found finished: its excess, this step's share included.
        self._book_slowdown(closed)
        self.last_step = step
        self._recent.append((step, self.cum))
        if self._pending:
            for s in self._pending:
                if step - n < s < step:  # a save inside a summary: its own share of it
                    k = s - (step - n)
                    self._commit(s, (c[0] + p, c[1] + tokens * k // n, c[2] + k))
            if step in self._pending:
                self._commit(step)
            self._pending = [s for s in self._pending if s > step]
        if a is not None:
            a["steps"] += n
            a["last_step"] = step
            if a["first_step"] is None:
                a["first_step"] = step - n + 1

    def _book_slowdown(self, excess: float) -> None:
        """A closed write's excess moves from productive time to ``slowdown``. Its steps are
        the newest of the timeline, so the kept cumulative time drops by the same amount."""
        self.sums["slowdown"] += excess
        self.productive_all -= excess
        c = self.cum
        self.cum = (c[0] - excess, c[1], c[2])

    def _checkpoint(self, step: int, t: float) -> None:
        self.last_ckpt_t = t if self.last_ckpt_t is None else max(self.last_ckpt_t, t)
        self.commits += 1
        self.commit_step = max(self.commit_step, step)
        if step == 0:
            return
        if step > self.last_step:
            self._pending.append(step)
            return
        self._commit(step)

    def _commit(self, step: int, cum: tuple[float, int, int] | None = None) -> None:
        self._ckpt[step] = self._lookup(step) if cum is None else cum
        self._ckpt.move_to_end(step)
        while len(self._ckpt) > _MAX_CHECKPOINTS:
            self._ckpt.popitem(last=False)
        # Async saves commit a few steps late: keep the steps after the committed one.
        self._recent = [(s, c) for s, c in self._recent if s > step]

    # -- state (the meter's restart snapshot) -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The complete state, JSON-serialisable; ``load_state_dict`` of it continues exactly
        (floats survive JSON unchanged). Size: the K newest checkpoints, the steps since
        the newest commit, one summary per attempt -- never the per-step history."""
        return {
            "version": STATE_VERSION,
            "start": self.start,
            "last_t": self.last_t,
            "progress_t": self.progress_t,
            "sums": dict(self.sums),
            "productive_all": self.productive_all,
            "attempts": self.attempts,
            "steps_recorded": self.steps_recorded,
            "cum": list(self.cum),
            "last_step": self.last_step,
            "steps_lost": self.steps_lost,
            "recent": [[s, *c] for s, c in self._recent],
            "pending": list(self._pending),
            "ckpt": [[s, *c] for s, c in self._ckpt.items()],
            "last_ckpt_t": self.last_ckpt_t,
            "commits": [self.commits, self.commits_reconciled, self.commit_step],
            # The open attempt is the last summary (the same dict object while live).
            "attempt_open": self._attempt is not None,
            "attempt_summaries": [dict(a) for a in self.attempt_summaries],
            **self._slow.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # Version 2 (an older run's snapshot on disk) lacks the carried baseline and the
        # unmeasured count: it loads with both empty rather than forcing a full replay.
        if sd.get("version") not in _LOADABLE_VERSIONS:
            raise ValueError(
                f"goodput state version {sd.get('version')!r} is not one this steadytrain "
                f"reads {_LOADABLE_VERSIONS}: replay the ledger instead (the meter does)"
            )

        def cum(v: list[Any]) -> tuple[float, int, int]:
            return (float(v[0]), int(v[1]), int(v[2]))

        self.start = sd["start"]
        self.last_t = sd["last_t"]
        # absent in an older snapshot: the gap then starts at the last record, as it did
        self.progress_t = sd.get("progress_t")
        sums = sd["sums"]
        self.sums = {
            k: float(sums.get(k, 0.0) if k in _ADDED_BUCKETS else sums[k]) for k in BUCKETS
        }
        self.productive_all = float(sd["productive_all"])
        self.attempts = int(sd["attempts"])
        self.steps_recorded = int(sd["steps_recorded"])
        self.cum = cum(sd["cum"])
        self.last_step = int(sd["last_step"])
        self.steps_lost = int(sd["steps_lost"])
        self._recent = [(int(r[0]), cum(r[1:])) for r in sd["recent"]]
        self._pending = [int(x) for x in sd.get("pending", [])]
        self._ckpt = OrderedDict((int(r[0]), cum(r[1:])) for r in sd["ckpt"])
        self.last_ckpt_t = sd["last_ckpt_t"]
        # An older snapshot has no commit counts: the newest remembered checkpoint stands
        # for the newest commit (the report replays the whole ledger and counts them all).
        self.commits, self.commits_reconciled, self.commit_step = (
            int(v) for v in sd.get("commits", [0, 0, max(self._ckpt, default=0)])
        )
        self.attempt_summaries = [dict(a) for a in sd["attempt_summaries"]]
        self._attempt = (
            self.attempt_summaries[-1] if sd["attempt_open"] and self.attempt_summaries else None
        )
        self._slow.load_state_dict(sd)

    # -- totals ----------------------------------------------------------------------------
    def breakdown(self, now: float | None = None) -> Breakdown:
        if self.start is None:
            return Breakdown(0.0, 0.0, dict.fromkeys(BUCKETS, 0.0), 0, 0, 0, 0, 0, 0, None)
        end = max(now if now is not None else 0.0, self.last_t or self.start)
        total = max(0.0, end - self.start)
        pending = self._slow.excess()  # a write still in flight: its slowdown so far
        goodput_s = max(0.0, self.productive_all - pending - self.sums["lost_to_failures"])
        bad = {k: max(0.0, v) for k, v in self.sums.items()}
        bad["slowdown"] += pending
        goodput_s, overbooked = _fit(total, goodput_s, bad)
        age_from = self.last_ckpt_t if self.last_ckpt_t is not None else self.start
        return Breakdown(
            total_s=total,
            goodput_s=goodput_s,
            badput_s=bad,
            attempts=self.attempts,
            steps_recorded=self.steps_recorded,
            steps_kept=self.cum[2],
            steps_lost=self.steps_lost,
            tokens_kept=self.cum[1],
            last_step=self.last_step,
            recovery_point_age_s=max(0.0, end - age_from),
            attempt_summaries=[dict(a) for a in self.attempt_summaries],
            slowdown_unmeasured_steps=self._slow.unmeasured,
            overbooked_s=overbooked,
            checkpoints=self.commits,
            checkpoints_reconciled=self.commits_reconciled,
        )


def _fit(total: float, goodput_s: float, bad: dict[str, float]) -> tuple[float, float]:
    """Make goodput and the buckets sum to ``total`` (``bad`` in place; returns goodput and
    the seconds overbooked). ``other`` takes what no record claims; when the records claim
    more than the wall time (a hostile or clock-broken ledger: a step of 1e8 s in a 10 s
    run), every figure is scaled down by the same factor, so goodput stays in [0, 1] and
    each bucket keeps its share of what was claimed."""
    claimed = goodput_s + sum(v for k, v in bad.items() if k != "other")
    over = claimed - total
    if over <= 1e-9 * max(1.0, total):  # float noise is not overbooking
        bad["other"] = max(0.0, total - claimed)
        return goodput_s, 0.0
    scale = total / claimed if claimed > 0 else 0.0
    for k in bad:
        bad[k] = 0.0 if k == "other" else bad[k] * scale
    return goodput_s * scale, over


def compute_goodput(records: Iterable[dict[str, Any]], now: float | None = None) -> Breakdown:
    """Goodput and the badput breakdown of a whole ledger (all attempts)."""
    acc = GoodputAccumulator()
    for rec in records:
        acc.add(rec)
    return acc.breakdown(now)


# Buckets of time inside steps that did no work (``data_stall_share``): the report's
# breakdown adds the two straggler buckets (rank 0 waiting for a slower rank's data or
# compute); rank 0's ledger alone has neither.
STALLS = ("data_wait", "slowdown", "straggler_wait", "straggler_compute")


def data_stall_share(b: Breakdown) -> float:
    """Share of the loop's time in steps, outside checkpoint blocks, that did no work:
    ``(stalls) / (stalls + productive time of every recorded step)``, kept or redone
    (``goodput_s + lost_to_failures``: redone steps waited too), where the stalls are
    ``data_wait + slowdown`` and, in the report's breakdown, ``straggler_wait +
    straggler_compute``. A step slowed by a background write, or waiting for a slower rank,
    is stalled like one waiting for data: the planner's model has one term for all.

    This is the planner's ``s`` (docs/planning.md): its model charges checkpoint blocks,
    restarts and lost work separately, so they stay out of the denominator; so does
    evaluation (``eval``), which the model has no term for. 0 when no step
    was recorded.
    """
    wait = sum(b.badput_s.get(k, 0.0) for k in STALLS)
    busy = wait + b.goodput_s + b.badput_s.get("lost_to_failures", 0.0)
    return wait / busy if busy > 0 else 0.0
