"""The job's state, from its records: finished, stopped, or still running.

A report of a job that is over must say so first (issue 42: after torchrun gave up at step
5 of 20, the report said only "4 attempt(s)" and its advice told the engineer to stop a job
that had already stopped). ``job_state(rec)`` reads the newest attempt:

- ``finished``: it ended with a clean ``job_end`` (``finished``, or the meter's
  ``interpreter_exit``);
- ``stopped``: it ended without one and no attempt followed: rank 0's ``job_end`` holds an
  error or a signal, or, rank 0 killed before writing one, a hang record or another rank's
  ``rank_end`` says the attempt failed. ``cause`` is ``failures``, or ``signal`` when every
  rank left on a signal (a cancelled or preempted job);
- ``running``: it has no end (and no failure) in the records: still running as of its last
  record, which is all the records can say (a job killed whole without a word looks the
  same).

``step`` is the furthest step any record of it reached (its restored step when it made
none); ``total_steps`` comes from ``job_start`` (``Run``'s ``total_steps``), else from the
reference loop's ``train.max_steps`` in the recorded config, else it is unknown (None).
"""

from __future__ import annotations

import time
from typing import Any

from steadytrain.diagnose.failures_attempts import CLEAN_REASONS, Attempt, attempts
from steadytrain.diagnose.inputs import RunRecords

__all__ = ["STATES", "job_state", "loop_advice", "state_advice"]

STATES = ("finished", "stopped", "running")


def _total_steps(start: dict[str, Any]) -> int | None:
    for v in (start.get("total_steps"), ((start.get("config") or {}).get("train") or {})):
        if isinstance(v, dict):
            v = v.get("max_steps")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _ended(a: Attempt) -> tuple[bool, bool]:
    """(ended, by a signal): whether the newest attempt is over, and whether every rank
    that said how it ended left on a signal."""
    if a.end is not None:
        reason = a.reason or ""
        return True, reason.startswith("signal:")
    reasons = [str(e["end"].get("reason") or "") for e in a.ranks.values() if e.get("end")]
    failed = [r for r in reasons if r not in CLEAN_REASONS]
    if a.hang is not None:
        return True, False
    if not failed:
        return False, False  # no end, or only clean ends of ranks while rank 0 closes
    return True, all(r.startswith("signal:") for r in failed)


def _last_t(rec: RunRecords) -> float | None:
    ts = [float(e["t"]) for e in rec.events if isinstance(e.get("t"), (int, float))]
    if len(rec.steps):
        ts.append(max(rec.steps.t))
    return max(ts) if ts else None


def job_state(rec: RunRecords, atts: list[Attempt] | None = None) -> dict[str, Any] | None:
    """``{"state", "cause", "step", "total_steps", "attempts", "last_t", "text"}`` for the
    run's newest attempt (module docstring); None when the records hold no attempt."""
    atts = attempts(rec) if atts is None else atts
    if not atts:
        return None
    a = atts[-1]
    step = a.last_step if a.last_step is not None else a.restored_step
    total = _total_steps(a.start)
    ended, signalled = _ended(a)
    clean = a.clean
    state = "finished" if clean else ("stopped" if ended else "running")
    cause = None if state != "stopped" else ("signal" if signalled else "failures")
    last_t = _last_t(rec)
    at = f"step {step}" + (f" of {total}" if total else "")
    n = len(atts)
    tries = f"{n} attempt{'s' if n != 1 else ''}"
    if state == "finished":
        text = f"job finished at {at}, {tries}"
    elif state == "stopped" and cause == "signal":
        text = f"job stopped by a signal (cancelled or preempted) at {at}, {tries}; nothing runs"
    elif state == "stopped":
        text = f"job stopped by failures at {at}, {tries}; no attempt followed the last failure"
    else:
        when = (
            "" if last_t is None else time.strftime(" (%Y-%m-%d %H:%M:%S UTC)", time.gmtime(last_t))
        )
        text = f"job still running as of the last record{when}: {at}, attempt {a.number}"
    return {
        "state": state,
        "cause": cause,
        "step": step,
        "total_steps": total,
        "attempts": n,
        "last_attempt": a.number,
        "last_t": last_t,
        "text": text,
    }


def state_advice(a: Attempt, nxt: Attempt | None, newest: Attempt) -> str:
    """What happened after attempt ``a`` failed, for an incident's advice: it restarted, it
    is still restarting, or the job stopped there (``newest``: the run's newest attempt)."""
    if nxt is None:
        return (
            f"The job did not restart after attempt {a.number}: it is stopped. Once the cause "
            "is fixed, start it again; it resumes from the newest committed checkpoint."
        )
    if nxt is newest and nxt.end is None and not _ended(nxt)[0]:
        return f"The job restarted: attempt {nxt.number} is running as of the last record."
    return f"The job restarted from step {nxt.restored_step} in attempt {nxt.number}."


def loop_advice(last: Attempt, after: Attempt | None, newest: Attempt) -> str:
    """What a restart loop's advice adds, by how it ended: the job stopped with it, is
    still restarting as of the last record, or got past it (``after``: the attempt after
    the loop's ``last``)."""
    if after is None:
        return (
            f"The job is stopped (attempt {last.number} was its last, the launcher gave up): "
            "there is nothing to stop; start it again once the cause is fixed."
        )
    if after is newest and not after.clean and not _ended(after)[0]:
        return (
            f"As of the last record it is still restarting (attempt {after.number}): stop the "
            "job first."
        )
    return f"The job got past it in attempt {after.number}."
