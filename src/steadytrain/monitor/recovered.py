"""Step records that a SIGKILL took from the ledger, recovered at the next start-up.

The meter hands records to the ledger from a background thread, so a killed process loses
the ones still queued. Two rules keep every step that a committed checkpoint covers in the
ledger (docs/monitoring.md, "Records survive SIGKILL"):

1. Before COMMIT, rank 0's writer waits for the meter (``GoodputMeter.record_through``, the
   Checkpointer's ``before_commit``) until the ledger file holds the step records up to the
   checkpoint's step. An asynchronous save's step is recorded right after ``maybe_save``
   returns, long before its background write ends, so the wait is normally nothing.
2. What rule 1 cannot cover -- a synchronous save commits inside ``maybe_save``, before its
   own step is recorded; a hook that timed out -- is recovered here: the next attempt
   restores step ``r`` (a committed checkpoint, so steps up to ``r`` were trained), and any
   step after the ledger's last recorded step up to ``r`` is written back as a ``step``
   record with ``"recovered": true``, placed before the new ``job_start`` so it belongs to
   the attempt that trained it.

A recovered step's timing is unknown: its durations are 0 and its ``t`` is the previous
record's, so it moves no second between buckets (the time it took stays in ``other`` /
``restart_gap``), while the step and its tokens count as kept.

The fill is bounded: a gap of up to ``PER_STEP_LIMIT`` steps (the usual one is a single
step, a synchronous save's own) is written one record per step; a larger one as ONE summary
record, a ``step`` record whose ``steps`` field says how many steps it stands for (``step -
steps + 1`` .. ``step``, ``tokens`` for all of them). Per-step records of unknown timing
carry nothing the summary does not, and a gap of 2,000,000 steps (a checkpoint of an absurd
step, a ledger lost with its disk) took 1 min 50 s and 930 MB to fill one by one
(issue 40, 3). The goodput arithmetic counts a summary as its ``steps`` steps
(``goodput.GoodputAccumulator``), so both forms give the same figures.

The commit itself can be lost the same way: an attempt killed right after COMMIT, before
its ``checkpoint`` record left the queue (issue 42: a restart loop restored step 4 three
times while its report said "0 checkpoints committed"). The next attempt knows that commit
from its restore (a durable restore of step ``r``, with the COMMIT's ``wall_time`` as the
restore event's ``commit_t``): when the ledger recorded no commit at or after ``r``,
``recovered_commit`` writes it back as a ``checkpoint`` record with ``"recovered": true``
(``t``: the COMMIT's time), after the recovered steps and before the new ``job_start``.
Readers that average save costs leave it out: its block and write times are unknown.
"""

from __future__ import annotations

from typing import Any

from steadytrain.monitor.goodput import GoodputAccumulator
from steadytrain.monitor.ledger import step_record
from steadytrain.monitor.records import MAX_INT

__all__ = ["PER_STEP_LIMIT", "recovered_commit", "recovered_steps"]

PER_STEP_LIMIT = 16  # a larger gap is one summary record


def recovered_steps(acc: GoodputAccumulator, restored_step: int) -> list[dict[str, Any]]:
    """The ``step`` records missing between the ledger's timeline (``acc``: every record so
    far) and the checkpoint this attempt restored. None for a ledger without history: a
    fresh run directory pointed at old checkpoints did not train those steps here."""
    if acc.start is None or restored_step <= acc.last_step:
        return []
    kept_steps, kept_tokens = acc.cum[2], acc.cum[1]
    tokens = kept_tokens // kept_steps if kept_steps else 0  # the run's tokens per step
    t = acc.last_t if acc.last_t is not None else acc.start
    gap = restored_step - acc.last_step
    if gap > PER_STEP_LIMIT:
        # Capped where the readers stop taking integers (records.MAX_INT).
        total = min(tokens * gap, MAX_INT - 1)
        rec = step_record(t, restored_step, total, 0.0, 0.0, 0.0, 0.0, None)
        return [{**rec, "recovered": True, "steps": gap}]
    out = []
    for s in range(acc.last_step + 1, restored_step + 1):
        rec = step_record(t, s, tokens, 0.0, 0.0, 0.0, 0.0, None)
        rec["recovered"] = True
        out.append(rec)
    return out


def recovered_commit(
    acc: GoodputAccumulator, restored: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The ``checkpoint`` record of the commit this attempt restored (``restored``: the
    checkpointer's ``restore`` event), when the ledger (``acc``) recorded no commit at or
    after its step; none for a memory-tier restore (no durable commit) or a ledger without
    history."""
    if acc.start is None or not isinstance(restored, dict):
        return []
    step, tier = restored.get("step"), restored.get("tier") or "durable"
    if tier != "durable" or not isinstance(step, int) or isinstance(step, bool):
        return []
    if step <= acc.commit_step or step > MAX_INT:
        return []
    when = restored.get("commit_t")
    ok_time = isinstance(when, (int, float)) and not isinstance(when, bool) and 0 < when < 1e11
    t = float(when) if ok_time else (acc.last_t if acc.last_t is not None else acc.start)
    path = restored.get("path")
    return [
        {
            "type": "checkpoint",
            "t": t,
            "step": step,
            "ok": True,
            "recovered": True,
            "path": path if isinstance(path, str) else "",
        }
    ]
