"""What a failed attempt cost, from the records: steps redone and the restart's wait.

``restart_cost(a, nxt)``: the attempt's last progress, the step the next attempt restored,
the steps it had to redo (times the attempt's own median step time) and the wall time from
the last progress to the next attempt's ``job_start`` (restart gap + start-up + restore:
``job_start`` is written once both are done). ``lost_s`` is their sum. Without a next
attempt (the job gave up) the work since the newest committed checkpoint is what is lost.
"""

from __future__ import annotations

from typing import Any

from steadytrain.diagnose.failures_attempts import Attempt

__all__ = ["cost_words", "last_commit", "restart_cost"]


def last_commit(a: Attempt) -> int:
    """The newest step this attempt committed (its restore point if none)."""
    steps = [
        int(e["step"])
        for e in a.events
        if e.get("type") == "checkpoint" and e.get("ok", True) and e.get("step") is not None
    ]
    return max([a.restored_step, *steps])


def restart_cost(
    a: Attempt,
    nxt: Attempt | None,
    step_s: float | None,
    progress_t: float | None = None,
    until_first_step: bool = False,
) -> dict[str, Any]:
    """The evidence of what ``a``'s failure cost. ``step_s``: the attempt's median step
    time (the run's when it made none). ``progress_t``: its last progress (default: its
    last step's time). ``until_first_step``: count the wait up to the next attempt's first
    step rather than its ``job_start`` (a hang: the restart had to make progress again)."""
    last = a.last_step if a.last_step is not None else a.restored_step
    last_t = progress_t if progress_t is not None else a.last_t
    if last_t is None:
        last_t = float(a.start["t"])
    st = step_s or 0.0
    out: dict[str, Any] = {
        "attempt": a.number,
        "last_step": last,
        "step_s": step_s,
        "last_progress_t": last_t,
    }
    if nxt is None:
        redone = max(0, last - last_commit(a))
        out.update(
            restarted=False,
            steps_uncommitted=redone,
            lost_s=redone * st,
        )
        return out
    redone = max(0, last - nxt.restored_step)
    resumed_t = float(nxt.start["t"])
    if until_first_step and nxt.first_t is not None:
        resumed_t = nxt.first_t
    wait = max(0.0, resumed_t - last_t)
    out.update(
        restarted=True,
        restart_attempt=nxt.number,
        restored_step=nxt.restored_step,
        steps_redone=redone,
        redone_s=redone * st,
        restart_s=wait,
        startup_s=float(nxt.start.get("startup_s") or 0) + float(nxt.start.get("restore_s") or 0),
        lost_s=redone * st + wait,
    )
    return out


def cost_words(c: dict[str, Any]) -> str:
    """ "restart cost 25.1 s (2 steps redone, 24.3 s until attempt 1 started)"."""
    if not c.get("restarted"):
        n = c.get("steps_uncommitted", 0)
        return f"the job did not restart; {n} step(s) since the last commit not saved"
    n = c["steps_redone"]
    return (
        f"restart cost {c['lost_s']:.1f} s ({n} step{'' if n == 1 else 's'} redone, "
        f"{c['restart_s']:.1f} s until attempt {c['restart_attempt']} was running)"
    )
