"""Failed saves and restart loops, once each attempt's own failure is known.

- ``fold_saves``: a save that failed in an attempt that then failed, with no successful
  save after it in that attempt, failed because the attempt was dying (a peer gone): it
  becomes evidence of that attempt's incident (``checkpoint_failed``), not a
  ``checkpoint`` incident with advice about saving.
- ``checkpoint_incidents``: every other failed save, its cause named from its error
  (``save_cause``: disk, store, lease, peer gone, else the error's first line, redacted);
  consecutive failures of one cause (no successful save between them) are one incident.
- ``restart_loops``: three or more failed attempts in a row, none of which got past its
  restored step by more than ``LOOP_STEPS`` or committed anything new (the attempt before
  them counts when the same fault struck it at the same step): one ``restart-loop``
  incident that replaces their crash/hang incidents, counted by the culprit's own cause,
  its advice by how the loop ended (stopped, still restarting, got past it).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from steadytrain.diagnose.failures_attempts import Attempt, Words, is_peer_error
from steadytrain.diagnose.incident import KINDS, Incident
from steadytrain.diagnose.job_state import loop_advice

__all__ = ["LOOP_MIN", "LOOP_STEPS", "checkpoint_incidents", "fold_saves", "restart_loops",
           "save_cause"]  # fmt: skip

LOOP_MIN = 3  # failed attempts in a row that make a loop
LOOP_STEPS = 2  # "almost no progress": at most this many steps past the restored one

_DISK = re.compile(
    r"ENOSPC|No space left|EIO\b|Input/output error|Read-only file system|EROFS|EDQUOT|"
    r"quota exceeded|\[Errno (?:5|28|30|122)\]",
    re.IGNORECASE,
)
_STORE = re.compile(
    r"NoCredential|credential|AccessDenied|Access Denied|Forbidden|\b40[13]\b|\b50[03]\b|"
    r"SlowDown|throttl|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|NoSuchBucket|"
    r"botocore|s3fs|gcsfs|adlfs|\bS3\b|EndpointConnectionError|ClientError|object store",
    re.IGNORECASE,
)
_LEASE = re.compile(r"lease", re.IGNORECASE)

CAUSE_ADVICE = {
    "disk": "The disk under the checkpoint directory failed the write (full, read-only or "
    "an I/O error): free space or point the checkpoints at a larger volume, and check dmesg "
    "for I/O errors.",
    "store": "The object store refused or failed the write: check the credentials (expired "
    "tokens), the bucket's permissions and throttling from the nodes.",
    "lease": "Another job holds or took this checkpoint root's writer lease: give each job "
    "its own run directory.",
    "peer gone": "A peer left during the save: see the crash or node loss around it.",
}


def save_cause(error: str | None) -> str:
    """``disk``, ``store``, ``lease``, ``peer gone`` or ``other`` for a save's error."""
    e = str(error or "")
    if _DISK.search(e):
        return "disk"
    if _STORE.search(e):
        return "store"
    if is_peer_error(e):
        return "peer gone"
    if _LEASE.search(e):
        return "lease"
    return "other"


def _failed_saves(a: Attempt) -> list[dict[str, Any]]:
    return [e for e in a.events if e.get("type") == "checkpoint" and e.get("ok") is False]


def fold_saves(atts: list[Attempt], failures: dict[int, Incident], words: Words) -> set[int]:
    """Fold each dying attempt's last failed saves into its incident; returns the ``id``
    of every save record folded."""
    folded: set[int] = set()
    for a in atts:
        inc = failures.get(a.index)
        if inc is None:
            continue
        saves = [e for e in a.events if e.get("type") == "checkpoint"]
        tail: list[dict[str, Any]] = []
        for e in saves:  # the failed saves after the attempt's last good one
            tail = [] if e.get("ok", True) else [*tail, e]
        tail = [e for e in tail if save_cause(e.get("error")) in ("peer gone", "other")]
        if not tail:
            continue
        inc.evidence["checkpoint_failed"] = [
            {"step": e.get("step"), "cause": "peer gone", "error": words.first_line(e.get("error"))}
            for e in tail
        ]
        n = len(tail)
        inc.message += (
            f"; {n} checkpoint save{'s' if n > 1 else ''} (step "
            f"{', '.join(str(e.get('step')) for e in tail)}) failed with it (peer gone)"
        )
        folded |= {id(e) for e in tail}
    return folded


def checkpoint_incidents(atts: list[Attempt], folded: set[int], words: Words) -> list[Incident]:
    """One ``checkpoint`` incident per run of failed saves with one cause."""
    out: list[Incident] = []
    group: list[tuple[Attempt, dict[str, Any], str]] = []

    def close() -> None:
        if group:
            out.append(_save_incident(group, words))
            group.clear()

    for a in atts:
        for e in a.events:
            if e.get("type") != "checkpoint":
                continue
            if e.get("ok", True):
                close()
                continue
            if id(e) in folded:
                continue
            cause = save_cause(e.get("error"))
            if group and group[-1][2] != cause:
                close()
            group.append((a, e, cause))
    close()
    return out


def _save_incident(group: list[tuple[Attempt, dict[str, Any], str]], words: Words) -> Incident:
    cause = group[0][2]
    first = words.first_line(group[0][1].get("error"))
    steps = [int(e["step"]) for _, e, _ in group if e.get("step") is not None]
    blocked = sum(float(e.get("block_s") or 0.0) for _, e, _ in group)
    n = len(group)
    said = cause if cause != "other" else (first or "unknown error")
    advice = KINDS["checkpoint"] + (" " + CAUSE_ADVICE[cause] if cause in CAUSE_ADVICE else "")
    span = f"step {steps[0]}" if len(set(steps)) <= 1 else f"steps {steps[0]}..{steps[-1]}"
    msg = f"{n} checkpoint save{'s' if n > 1 else ''} failed ({span}): {said}"
    if cause != "other" and first:
        msg += f": {first}"
    return Incident(
        kind="checkpoint",
        first_step=steps[0] if steps else None,
        last_step=steps[-1] if steps else None,
        lost_s=blocked,
        evidence={
            "cause": cause,
            "error": first,
            "failed_saves": n,
            "steps": steps,
            "attempts": sorted({a.number for a, _, _ in group}),
            "block_s": blocked,
        },
        advice=advice,
        message=msg,
        t=group[0][1].get("t"),
        attempt=group[0][0].number,
    )


def _stuck(a: Attempt, nxt: Attempt | None) -> bool:
    """No (or almost no) progress past the restored step, or nothing new committed."""
    progress = (a.last_step if a.last_step is not None else a.restored_step) - a.restored_step
    return progress <= LOOP_STEPS or (nxt is not None and nxt.restored_step <= a.restored_step)


def _cause(i: Incident) -> str:
    """What a loop counts: the culprit's own words (``cause``), never a survivor's."""
    return f"{i.kind}: {i.evidence.get('cause') or i.evidence.get('reason') or i.message}"


def restart_loops(
    atts: list[Attempt], incidents: list[Incident], failures: dict[int, Incident], words: Words
) -> list[Incident]:
    """``incidents`` with each run of ``LOOP_MIN``+ stuck failed attempts as one
    ``restart-loop`` in place of their crash/hang incidents (node losses stay). The failed
    attempt just before such a run joins it when it failed at the step they fail at, with
    the cause they repeat: the first time the fault struck is the loop's first, not an
    incident of its own (issue 42), and it counts towards ``LOOP_MIN``."""
    runs: list[list[Attempt]] = []
    cur: list[Attempt] = []
    # restarts that admitted a node (failures_rejoin): part of the failure before them, so
    # they neither count nor break a run (a hang, a rejoin, the same hang again is a loop)
    rejoins = {r["attempt"] for i in failures.values() for r in i.evidence.get("rejoined", [])}
    for a in atts:
        if a.number in rejoins:
            continue
        nxt = atts[a.index + 1] if a.index + 1 < len(atts) else None
        if a.index in failures and _stuck(a, nxt):
            cur.append(a)
            continue
        runs.append(cur)
        cur = []
    runs.append(cur)
    loops = []
    for run in runs:
        if not run:
            continue
        first = _first_time(atts, run, failures, rejoins)
        if len(run) + (first is not None) >= LOOP_MIN:
            loops.append((first, run))
    if not loops:
        return incidents
    replaced: set[int] = set()
    out_loops = []
    for first, run in loops:
        parts = [failures[a.index] for a in run]
        replaced |= {id(i) for i in parts if i.kind in ("crash", "hang")}
        if first is not None:
            replaced.add(id(failures[first.index]))
        out_loops.append(_loop_incident(run, parts, atts, first, failures))
    return [i for i in incidents if id(i) not in replaced] + out_loops


def _first_time(
    atts: list[Attempt], run: list[Attempt], failures: dict[int, Incident], rejoins: set[int]
) -> Attempt | None:
    """The failed attempt before ``run`` (past any restart that admitted a node) when the
    same fault struck it at the same step."""
    i = run[0].index - 1
    while i >= 0 and atts[i].number in rejoins:
        i -= 1
    if i < 0 or i not in failures or failures[i].kind not in ("crash", "hang"):
        return None
    p = atts[i]
    causes = {_cause(failures[a.index]) for a in run}
    steps = {a.last_step for a in run}
    if causes == {_cause(failures[i])} and p.last_step in steps:
        return p
    return None


def _loop_incident(
    run: list[Attempt],
    parts: list[Incident],
    atts: list[Attempt],
    first: Attempt | None,
    failures: dict[int, Incident],
) -> Incident:
    every = ([failures[first.index]] if first is not None else []) + parts
    reasons = [_cause(i) for i in every]
    common, times = Counter(reasons).most_common(1)[0]
    last = run[-1]
    after = atts[last.index + 1] if last.index + 1 < len(atts) else None
    end_t = (
        float(after.start["t"])
        if after is not None
        else float((last.end or {}).get("t") or last.last_t or last.start["t"])
    )
    nodes = sorted({n for i in every for n in i.nodes})
    ranks = sorted({r for i in every for r in i.ranks})
    numbers = ([first.number] if first is not None else []) + [a.number for a in run]
    stuck_at = {a.last_step for a in run}
    at = f" at step {stuck_at.pop()}" if len(stuck_at) == 1 else ""
    msg = (
        f"restart loop: attempts {numbers[0]}..{numbers[-1]} ({len(numbers)}) failed{at}; "
        f"{len(run)} of them restarted from step {max(a.restored_step for a in run)} and got "
        f"no further; {times} of {len(numbers)}: {common}"
    )
    # from the loop's first failure (the first time's last progress, its redone steps)
    lost_s = max(0.0, end_t - run[0].began)
    t = run[0].began
    if first is not None:
        ev = failures[first.index].evidence
        since = float(ev.get("last_progress_t") or run[0].began)
        lost_s = max(0.0, end_t - since) + float(ev.get("redone_s") or 0.0)
        t = since
    return Incident(
        kind="restart-loop",
        nodes=nodes,
        ranks=ranks,
        first_step=min(a.restored_step for a in run),
        last_step=max((a.last_step or a.restored_step) for a in run),
        lost_s=lost_s,
        evidence={
            "attempts": numbers,
            "reason": common,
            "repeats": times,
            "reasons": reasons,
            "restored_steps": [a.restored_step for a in run],
            "last_steps": [a.last_step for a in run],
            "first_time": None if first is None else first.number,
        },
        advice=f"{KINDS['restart-loop']} {loop_advice(last, after, atts[-1])}",
        message=msg,
        t=t,
        attempt=numbers[0],
    )
