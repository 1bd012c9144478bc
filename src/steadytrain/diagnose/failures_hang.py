"""Hang incidents: which rank(s) stopped making progress, where, and in what state.

The watchdog's ledger ``hang`` record (and, when rank 0 could not write one, the verdict
files under ``hangs/attempt-A/``) name the stuck ranks, the phase and the frame. A rank
that never answered (SIGSTOPped, its node's link down) has no verdict and so no node in
the record: its node comes from its rank file's ``rank_start`` for that attempt. The
node-local reaper's file (``reaped-rank-R.json``) says what state the process was in when
it was killed: stopped (``T``), sleeping (``S``), in uninterruptible sleep (``D``).

Without the watchdog a hang ends at the backend's collective timeout: an attempt whose
every rank failed with a timeout long after its last step is a hang too
(``backend_timeout_hang``), blamed on the node the errors name when a rank file maps its
address.
"""

from __future__ import annotations

import re
from typing import Any

from steadytrain.diagnose.failures_attempts import Attempt, Words
from steadytrain.diagnose.failures_cost import cost_words, restart_cost
from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.monitor.hangs import decide

__all__ = ["backend_timeout_hang", "hang_incident", "short_frame"]

# /proc/PID/stat state letters (proc(5)) as the report words them
PROC_STATES = {
    "T": "stopped",
    "t": "stopped (traced)",
    "S": "sleeping",
    "D": "in uninterruptible sleep (disk or device)",
    "R": "running",
    "Z": "a zombie",
    "I": "idle",
}
_SHORT = {"T": "stopped", "t": "stopped", "S": "sleeping", "D": "uninterruptible",
          "R": "running", "Z": "zombie", "I": "idle"}  # fmt: skip
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
# A timeout error this long after the last step (and this many step times) is a hang
# the backend ended, not a slow step.
HANG_MIN_S, HANG_MIN_STEPS = 5.0, 10


def short_frame(frame: str | None) -> str | None:
    """A frame without the machine's paths: "torch/autograd/graph.py:979 _engine_run_backward"
    (from site-packages on), else the file's last three path parts."""
    if not frame:
        return frame
    path, _, rest = str(frame).partition(" ")
    path = path.replace("\\", "/")
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            path = path.rsplit(mark, 1)[1]
            break
    else:
        path = "/".join(path.split("/")[-3:])
    return f"{path} {rest}".strip()


def _state(rank: int, entry: dict[str, Any], verdict: dict[str, Any] | None,
           reaped: dict[str, Any] | None) -> tuple[str, str]:  # fmt: skip
    """(short state, words) of one stuck rank."""
    if reaped and (reaped.get("proc_state") or reaped.get("proc_state_name")):
        code = str(reaped.get("proc_state") or "")
        name = PROC_STATES.get(code) or str(reaped.get("proc_state_name") or code)
        short = _SHORT.get(code, name)
        sig = reaped.get("signal") or "SIGKILL"
        return short, f"was {name} when the reaper killed it ({sig})"
    v = verdict or entry
    state = v.get("state")
    if state == "waiting":
        inside = v.get("waiting_in")
        return "waiting", "was waiting in a collective" + (f" ({inside})" if inside else "")
    if state == "stuck":
        frame = short_frame(v.get("frame"))
        return "stuck", "was stuck outside any collective" + (f" at {frame}" if frame else "")
    return "no response", "never answered the watchdog (stopped, or its node unreachable)"


def _who(stuck: list[dict[str, Any]]) -> str:
    """ "rank 1 on node-1 was stopped ...", or for several ranks in one state "ranks 0, 1
    on node-0, node-1 were all waiting in a collective (backward)"."""
    if not stuck:
        return "no rank named"
    details = {s["detail"] for s in stuck}
    if len(stuck) > 1 and len(details) == 1 and stuck[0]["detail"].startswith("was "):
        nodes = sorted({str(s["node"]) for s in stuck if s["node"]})
        return (
            f"ranks {', '.join(str(s['rank']) for s in stuck)}"
            + (f" on {', '.join(nodes)}" if nodes else "")
            + f" were all {stuck[0]['detail'][4:]}"
        )
    return "; ".join(
        f"rank {s['rank']}" + (f" on {s['node']}" if s["node"] else "") + f" {s['detail']}"
        for s in stuck
    )


def hang_incident(
    rec: RunRecords, a: Attempt, nxt: Attempt | None, step_s: float | None, words: Words
) -> Incident | None:
    """The watchdog's hang of attempt ``a``, if it recorded one. Verdicts and reaper files
    are files anyone could drop: those of a rank the attempt never had (its ``job_start``
    says the world) or of another run (its ``run_nonce``) name nobody."""
    verdicts = _ours(rec.verdicts.get(a.number, {}), a)
    reaped = _ours(rec.reaped.get(a.number, {}), a, nonce=False)
    h = a.hang
    if h is None and not verdicts and not reaped:
        return None
    if h is None and verdicts:
        d = decide(verdicts, a.world)
        h = {"stuck_ranks": d["stuck_ranks"], "stuck": d["stuck"], "cause": d["cause"],
             "missing_ranks": d["missing_ranks"]}  # fmt: skip
        h["step"] = min((int(v.get("step") or 0) for v in verdicts.values()), default=None)
        h["phase"] = next((v.get("phase") for v in verdicts.values() if v.get("phase")), None)
        h["progress_t"] = min((float(v["progress_t"]) for v in verdicts.values()), default=None)
        h["detect_t"] = min((float(v["detect_t"]) for v in verdicts.values()), default=None)
        h["frame"] = (d["stuck"][0] if d["stuck"] else {}).get("frame")
    h = h or {"stuck_ranks": sorted(reaped), "stuck": [], "cause": "killed by the reaper"}
    ranks = sorted({int(r) for r in h.get("stuck_ranks") or []} | set(reaped))
    entries = {int(e["rank"]): e for e in h.get("stuck") or [] if e.get("rank") is not None}
    stuck: list[dict[str, Any]] = []
    nodes: list[str] = []
    for r in ranks:
        e, v, k = entries.get(r, {}), verdicts.get(r), reaped.get(r)
        node = e.get("node") or (v or {}).get("node") or (k or {}).get("node") or a.node_of(r)
        short, said = _state(r, e, v, k)
        if node and node not in nodes:
            nodes.append(str(node))
        stuck.append({
            "rank": r, "node": node, "state": short, "detail": said,
            "frame": short_frame(e.get("frame") or (v or {}).get("frame")),
            "proc_state": (k or {}).get("proc_state"),
            "reaped_because": (k or {}).get("reason"), "pid": (k or {}).get("pid"),
        })  # fmt: skip
    states = [s["state"] for s in stuck]
    state = next((s for s in ("stopped", "uninterruptible", "stuck", "sleeping", "no response", "waiting") if s in states),
                 states[0] if states else "unknown")  # fmt: skip
    progress_t = h.get("progress_t") if h.get("progress_t") is not None else a.last_t
    cost = restart_cost(a, nxt, step_s, progress_t=progress_t, until_first_step=True)
    step = h.get("step") if h.get("step") is not None else a.last_step
    frame = short_frame(h.get("frame")) or next((s["frame"] for s in stuck if s["frame"]), None)
    detect_s = None
    if h.get("detect_t") is not None and progress_t is not None:
        detect_s = max(0.0, float(h["detect_t"]) - float(progress_t))
    who = _who(stuck)
    msg = (
        f"hang in attempt {a.number} after step {step}"
        + (f" ({h['phase']})" if h.get("phase") else "")
        + f": {who}"
        + (f"; frame {frame}" if frame else "")
        + (f"; detected after {detect_s:.1f} s" if detect_s is not None else "")
        + f"; {cost_words(cost)}"
    )
    came_back = None
    if nxt is not None and nxt.ranks:
        came_back = {n: n in nxt.nodes() for n in nodes}
        gone = [n for n, back in came_back.items() if not back]
        if gone:  # still a hang (that is what the records saw), its node never returned
            msg += f"; {', '.join(gone)} did not rejoin (the job went on without it)"
    evidence = {
        **cost,
        "cause": h.get("cause"),
        "phase": h.get("phase"),
        "frame": frame,
        "state": state,
        "stuck": stuck,
        "detect_s": detect_s,
        "deadline_s": h.get("deadline_s"),
        "dump_dir": h.get("dump_dir") or f"hangs/attempt-{a.number}",
        "detected_by": "watchdog" if a.hang is not None or verdicts else "reaper",
        "nodes_came_back": came_back,
    }
    return Incident(
        kind="hang",
        nodes=nodes,
        ranks=ranks,
        first_step=step,
        last_step=step,
        lost_s=float(cost.get("lost_s") or 0.0),
        evidence=evidence,
        message=msg,
        t=progress_t,
        attempt=a.number,
    )


def _ours(
    files: dict[int, dict[str, Any]], a: Attempt, nonce: bool = True
) -> dict[int, dict[str, Any]]:
    """The rank files of attempt ``a``'s own ranks (and, when its ``job_start`` names the
    run's nonce and ``nonce``, only those that carry it)."""
    run_nonce = a.start.get("run_nonce") if nonce else None
    return {
        r: v
        for r, v in files.items()
        if 0 <= r < a.world and (not run_nonce or v.get("nonce") == run_nonce)
    }


def backend_timeout_hang(
    a: Attempt, nxt: Attempt | None, step_s: float | None, words: Words
) -> Incident | None:
    """No watchdog: every rank that wrote an end failed on a timeout, long after its last
    step (the backend's collective timeout ended the hang)."""
    reasons = [str((e.get("end") or {}).get("reason") or "") for e in a.ranks.values()]
    reasons = [r for r in reasons if r] or [a.reason or ""]
    if not all(r.startswith("error") and _TIMEOUT.search(r) for r in reasons):
        return None
    end_t = (a.end or {}).get("t")
    if end_t is None or a.last_t is None:
        return None
    stalled = float(end_t) - a.last_t
    if stalled < max(HANG_MIN_S, HANG_MIN_STEPS * (step_s or 0.0)):
        return None
    named = [n for r in reasons for n in words.peers(r)]
    silent = sorted(r for r, e in a.ranks.items() if not e.get("end"))
    ranks = sorted(r for r, e in a.ranks.items() if e.get("node") in named) or silent
    cause = "the rank(s) the others waited for"
    if not ranks:
        # Nothing tells the sides apart (a partition: each waits for the other), so every
        # rank is named, as the watchdog names every rank when all of them wait.
        ranks, cause = sorted(a.ranks), "every rank waited in a collective"
    nodes = sorted({n for r in ranks if (n := a.node_of(r))}) or sorted(set(named))
    cost = restart_cost(a, nxt, step_s, until_first_step=True)
    said = words.line(reasons[0])
    step = a.last_step
    where = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
             + (f" on {', '.join(nodes)}" if nodes else "")) if ranks else "no rank named"  # fmt: skip
    msg = (
        f"hang in attempt {a.number} after step {step}, ended by the backend's timeout "
        f"{stalled:.1f} s later (no watchdog verdict): {where} ({cause}); {said}; "
        f"{cost_words(cost)}"
    )
    evidence = {
        **cost,
        "cause": f"backend timeout: {cause}",
        "state": "waiting",
        "detected_by": "backend timeout",
        "detect_s": stalled,
        "reason": said,
        "stuck": [{"rank": r, "node": a.node_of(r), "state": "waiting"} for r in ranks],
    }
    return Incident(
        kind="hang",
        nodes=nodes,
        ranks=ranks,
        first_step=step,
        last_step=step,
        lost_s=float(cost.get("lost_s") or 0.0),
        evidence=evidence,
        message=msg,
        t=a.last_t,
        attempt=a.number,
    )
