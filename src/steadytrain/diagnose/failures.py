"""Failures found from a run's own records: crash, node-loss, hang, checkpoint, restart-loop.

``detect(rec)`` walks the attempts (``failures_attempts.attempts``): every attempt that
ended without a clean ``job_end`` (or was followed by another without one) is one incident,
the first of these that fits:

- ``hang``: the watchdog recorded one (ledger ``hang``, verdicts, the reaper's files), or
  every rank's error is a collective's timeout long after the last step
  (``failures_hang``);
- ``node-loss``: a node of the failed attempt that no later attempt ran on, while another
  node went on (how its ranks stopped -- no ``rank_end``, named by its peers' errors, a
  signal -- is evidence); whether a spare took its seat and read remotely at its start;
- ``crash``: by rank and node: the rank that raised its own error, else the one that died
  without a word, else the one its peers' errors name, else the one whose records stop
  first. Never an IP address (``Words``).

A failed save in such an attempt with no later successful one is that failure's doing
(``peer gone``): it is folded into the incident's evidence, not reported apart; every
other failed save is a ``checkpoint`` incident naming its cause, and three or more failed
attempts in a row without progress are one ``restart-loop`` (``failures_more``).

An attempt that every rank left on SIGTERM with nothing to redo (a planned preemption, a
cancelled job resumed from its last step) is no incident; nor is one that every rank left
on SIGTERM when the next attempt admitted a node (torchelastic restarting to grow the job,
``failures_rejoin``): its cost goes to the previous attempt's incident.
"""

from __future__ import annotations

import statistics
from typing import Any

from steadytrain.diagnose.failures_attempts import (
    CLEAN_REASONS,
    Attempt,
    Words,
    attempts,
    is_peer_error,
)
from steadytrain.diagnose.failures_cost import cost_words, restart_cost
from steadytrain.diagnose.failures_hang import backend_timeout_hang, hang_incident
from steadytrain.diagnose.failures_more import (
    checkpoint_incidents,
    fold_saves,
    restart_loops,
)
from steadytrain.diagnose.failures_rejoin import admitted, fold_rejoin
from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.diagnose.job_state import state_advice

__all__ = ["detect"]


def detect(rec: RunRecords) -> list[Incident]:
    """Every failure incident of the run, sorted by first step."""
    atts = attempts(rec)
    words = Words(rec)
    run_step_s = _run_step_s(atts)
    failures: dict[int, Incident] = {}  # attempt index -> its incident
    for a in atts:
        nxt = atts[a.index + 1] if a.index + 1 < len(atts) else None
        if not _failed(rec, a, nxt):
            continue
        step_s = a.step_s or run_step_s
        if _stopped_cleanly(a, nxt, step_s):
            continue
        if _stopped_from_outside(a) and (joined := admitted(a, nxt)):
            # the agent stopped the workers to admit a node (failures_rejoin.py): what
            # it cost belongs to what made the job start without that node
            if (prev := failures.get(a.index - 1)) is not None:
                fold_rejoin(prev, atts[a.index - 1], a, joined, restart_cost(a, nxt, step_s))
            continue
        inc = (
            hang_incident(rec, a, nxt, step_s, words)
            or backend_timeout_hang(a, nxt, step_s, words)
            or _node_loss(a, nxt, atts, step_s, words)
            or _crash(a, nxt, step_s, words)
        )
        if inc is not None:
            # the advice fits what happened next: restarted, or stopped there (issue 42)
            inc.advice = f"{inc.advice} {state_advice(a, nxt, atts[-1])}"
            failures[a.index] = inc
    folded = fold_saves(atts, failures, words)
    out = list(failures.values())
    out += checkpoint_incidents(atts, folded, words)
    out = restart_loops(atts, out, failures, words)
    return sorted(out, key=lambda i: (i.first_step is None, i.first_step or 0, i.t or 0.0))


def _run_step_s(atts: list[Attempt]) -> float | None:
    xs = [a.step_s for a in atts if a.step_s]
    return statistics.median(xs) if xs else None


def _failed(rec: RunRecords, a: Attempt, nxt: Attempt | None) -> bool:
    """Ended without a clean job_end: an error, a signal, a hang, or no job_end at all
    before the next attempt (the newest one without job_end may still be running)."""
    if a.clean:
        return False  # a finished attempt had no failure, whatever a dump dir holds
    if a.hang is not None or (a.number in rec.verdicts and nxt is not None):
        return True
    if a.end is None:
        return nxt is not None
    return not a.clean


def _reason(e: dict[str, Any]) -> str:
    return str((e.get("end") or {}).get("reason") or "")


def _signalled(reason: str) -> bool:
    return reason.startswith("signal:")


def _own_error(reason: str) -> bool:
    """The rank's own exception (not a signal, not its peer's failure)."""
    return (
        bool(reason)
        and reason not in CLEAN_REASONS
        and not _signalled(reason)
        and (not is_peer_error(reason))
    )


def _culprits(a: Attempt, words: Words) -> tuple[list[int], str]:
    """The ranks a crash is blamed on and how they were found."""
    ranks = a.ranks
    silent = sorted(r for r, e in ranks.items() if not e.get("end"))
    own = sorted(r for r, e in ranks.items() if _own_error(_reason(e)))
    if own:
        return own, "raised"
    if silent and len(silent) < len(ranks):
        return silent, "silent"
    named = _peer_nodes(a, words)
    by_peers = sorted(r for r, e in ranks.items() if e.get("node") in named)
    if by_peers and len(by_peers) < len(ranks):
        return by_peers, "named"
    last = {r: e.get("last_step") for r, e in ranks.items() if e.get("last_step") is not None}
    if last and len(set(last.values())) > 1:
        low = min(last.values())
        return sorted(r for r, s in last.items() if s == low), "first to stop"
    return sorted(ranks), "all" if silent else "unknown"


def _peer_nodes(a: Attempt, words: Words) -> list[str]:
    """Nodes the attempt's error messages name (by a peer address a rank file maps)."""
    out: list[str] = []
    texts = [_reason(e) for e in a.ranks.values()] + [a.reason or ""]
    for t in texts:
        for n in words.peers(t):
            if n not in out:
                out.append(n)
    return out


def _survivor_reason(a: Attempt) -> str:
    """What the ranks that lived said (the first peer error), else rank 0's job_end."""
    for _, e in sorted(a.ranks.items()):
        if is_peer_error(_reason(e)):
            return _reason(e)
    return a.reason or ""


def _stopped_from_outside(a: Attempt) -> bool:
    """Every rank (rank 0's job_end without rank files) left on a signal, none silent."""
    if a.hang is not None:
        return False
    reasons = [_reason(e) for e in a.ranks.values()] or [a.reason or ""]
    return all(_signalled(r) for r in reasons)


def _stopped_cleanly(a: Attempt, nxt: Attempt | None, step_s: float | None) -> bool:
    """A planned stop (preemption, a cancelled job resumed): every rank left on SIGTERM and
    the next attempt went on from the attempt's last step. Nothing to act on, wherever the
    next attempt ran."""
    if nxt is None or not _stopped_from_outside(a):
        return False
    return not restart_cost(a, nxt, step_s).get("steps_redone")


def _crash(a: Attempt, nxt: Attempt | None, step_s: float | None, words: Words) -> Incident | None:
    cost = restart_cost(a, nxt, step_s)
    ranks, how = _culprits(a, words)
    if _stopped_from_outside(a) and how in ("unknown", "all", "first to stop"):
        how = "signalled"  # preemption or a cancelled job that cost redone steps
    nodes = sorted({n for r in ranks if (n := a.node_of(r))})
    # The job's last step, not the culprit's last record: in data parallelism every rank
    # took part in every step the others finished; a killed rank's newest records are lost.
    step = cost["last_step"]
    own = [int(a.ranks[r]["last_step"]) for r in ranks if a.ranks[r].get("last_step") is not None]
    if how == "raised":
        said = words.line(_reason(a.ranks[ranks[0]]))
    else:
        said = words.line(_survivor_reason(a)) or ("killed (no job_end)" if a.end is None else "")
    who = _who(ranks, a)
    what = {
        "raised": f"{who} failed",
        "silent": f"{who} died without a word (no rank_end: killed, out of memory or a segfault)",
        "named": f"{who} is what the other ranks lost",
        "first to stop": f"{who} stopped first",
        "signalled": "every rank was stopped from outside (a signal: preemption or a "
        "cancelled job)",
        "all": "every rank died without a word (the whole job was killed)",
        "unknown": "the attempt ended without a clean end",
    }[how]
    msg = f"crash in attempt {a.number} at step {step}: {what}" + (f": {said}" if said else "")
    evidence = {
        **cost,
        "culprit": how,
        "culprit_last_recorded_step": min(own, default=None),
        "reason": said,
        # the fault in the culprit's own terms, what a restart loop counts (issue 42): a
        # survivor's socket error (gloo words one lost peer several ways) is not a cause
        "cause": f"{what}: {said}" if how == "raised" and said else what,
        "ranks_ended": {str(r): words.line(_reason(e)) or None for r, e in sorted(a.ranks.items())},
        "peer_nodes": _peer_nodes(a, words),
    }
    return Incident(
        kind="crash",
        nodes=nodes,
        ranks=ranks,
        first_step=step,
        last_step=a.last_step,
        lost_s=float(cost.get("lost_s") or 0.0),
        evidence=evidence,
        message=f"{msg}; {cost_words(cost)}",
        t=cost["last_progress_t"],
        attempt=a.number,
    )


def _who(ranks: list[int], a: Attempt) -> str:
    """ "rank 1 on node-1", "ranks 2, 3 on node-b"."""
    if not ranks:
        return "a rank"
    nodes = sorted({n for r in ranks if (n := a.node_of(r))})
    s = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return s + (f" on {', '.join(nodes)}" if nodes else "")


def _node_loss(
    a: Attempt, nxt: Attempt | None, atts: list[Attempt], step_s: float | None, words: Words
) -> Incident | None:
    """The node(s) of ``a`` that went silent (or that the others' errors name) and that no
    later attempt ran on, while another node of ``a`` went on."""
    later = [b for b in atts if b.index > a.index]
    if nxt is None or not nxt.ranks:
        return None  # no later rank files: where the job went on is unknown
    later_nodes = {n for b in later for n in b.nodes()}
    named = set(_peer_nodes(a, words))
    # However its ranks ended (killed without a word, SIGTERMed by a drain, their own
    # error on a failing device), a node of a failed attempt that no later attempt ran on
    # left the job, while the others went on.
    lost = {n: rs for n, rs in a.nodes().items() if n not in later_nodes}
    if not lost or len(lost) == len(a.nodes()):
        return None  # nothing lost, or the whole job moved (rescheduled): a crash
    ranks = sorted(r for rs in lost.values() for r in rs)
    how = {
        n: "named by its peers' errors"
        if n in named
        else "no rank_end (killed or unreachable)"
        if all(not a.ranks[r].get("end") for r in rs)
        else words.line(_reason(a.ranks[rs[0]]))
        for n, rs in lost.items()
    }
    stops = [int(a.ranks[r]["last_step"]) for r in ranks if a.ranks[r].get("last_step") is not None]
    cost = restart_cost(a, nxt, step_s)
    step = cost["last_step"]  # the job's last step: the lost ranks took part in it
    seat = _seat(a, nxt, atts, ranks)
    nodes = sorted(lost)
    said = words.line(_survivor_reason(a))
    msg = (
        f"{', '.join(nodes)} lost at step {step} in attempt {a.number} (rank"
        f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped and never "
        f"came back there); {seat['words']}; {cost_words(cost)}"
    )
    evidence = {
        **cost,
        "lost_nodes": nodes,
        "how_it_stopped": how,
        "last_recorded_step": min(stops, default=None),  # the lost ranks' own newest
        **{k: v for k, v in seat.items() if k != "words"},
        "reason": said,
    }
    return Incident(
        kind="node-loss",
        nodes=nodes,
        ranks=ranks,
        first_step=step,
        last_step=a.last_step,
        lost_s=float(cost.get("lost_s") or 0.0),
        evidence=evidence,
        message=msg,
        t=cost["last_progress_t"],
        attempt=a.number,
    )


def _seat(a: Attempt, nxt: Attempt, atts: list[Attempt], ranks: list[int]) -> dict[str, Any]:
    """Who took the lost ranks' seats in ``nxt``: a spare (a node new to the job), with
    what it read in its first steps, or nobody (the world shrank)."""
    seen = {n for b in atts if b.index <= a.index for n in b.nodes()}
    new = {n: rs for n, rs in nxt.nodes().items() if n not in seen}
    out: dict[str, Any] = {"world_before": a.world, "world_after": nxt.world}
    if nxt.world < a.world or not new:
        out.update(
            spare=None,
            words=f"no spare: the job went on with {nxt.world} of {a.world} rank(s)"
            if nxt.world < a.world
            else "the surviving nodes took the seats (no new node)",
        )
        return out
    spares = sorted(new)
    reads = {"steps": 0, "cache_misses": 0, "cache_hits": 0, "bytes_read": 0}
    for n in spares:
        for r in new[n]:
            e = nxt.ranks[r]
            reads["steps"] += int(e.get("early_steps") or 0)
            for k in ("cache_misses", "cache_hits", "bytes_read"):
                reads[k] += int(e.get(f"early_{k}") or 0)
    remote = reads["cache_misses"] > 0
    how = (
        f"read remotely: {reads['cache_misses']} cache miss(es) in its first "
        f"{reads['steps']} step(s)"
        if remote
        else f"read nothing remotely in its first {reads['steps']} step(s) (staged)"
    )
    out.update(
        spare=spares[0],
        spares=spares,
        spare_ranks=sorted(r for n in spares for r in new[n]),
        spare_first_steps=reads,
        spare_read_remotely=remote,
        words=f"spare {', '.join(spares)} took the seat in attempt {nxt.number} and {how}",
    )
    return out
