"""What a hang is once the watchdog saw one: where each rank stands, who is to blame, the
ledger record.

Policy apart from mechanism: ``watchdog.py`` decides *when* (deadlines, the daemon thread,
the exit); this module decides *what*: each rank's verdict from its loop thread's stack
(``classify_stack``), the culprits from every verdict that arrived (``decide``), the ``hang``
ledger record (docs/format.md), and the records an earlier attempt could not write
(``recover_hang_records``). Pure functions over plain dicts, so the unit tests need no hang.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from steadytrain.monitor.reaper import (  # the reaper's files
    DECISION,
    REAPED,
    STOPPED_NOTE,
    reaped_path,
)
from steadytrain.monitor.records import VERDICT_FIELDS, Rejects, check_fields, read_json
from steadytrain.storage.publish import publish_bytes

__all__ = [
    "DECISION",
    "HANGS_DIR",
    "REAPED",
    "RECORDED",
    "classify_stack",
    "decide",
    "hang_dir",
    "hang_record",
    "publish_decision",
    "read_stopped",
    "read_verdicts",
    "reaped_path",
    "recover_hang_records",
    "thread_frames",
    "where",
]

log = logging.getLogger("steadytrain.monitor")

HANGS_DIR = "hangs"
RECORDED = "recorded.json"  # published once the hang's ledger record is on disk


_WRAPPERS = ("torch/distributed/c10d_logger.py", "/contextlib.py", "/functools.py")
_COLLECTIVES = frozenset(
    "all_reduce all_gather all_gather_into_tensor all_gather_object all_to_all "
    "all_to_all_single barrier monitored_barrier broadcast broadcast_object_list gather "
    "gather_object reduce reduce_scatter reduce_scatter_tensor scatter scatter_object_list "
    "send recv isend irecv wait _all_gather_base".split()
)


STACK_FRAMES = 12  # innermost frames of the loop thread kept in a verdict and the record


def where(filename: str, lineno: int, name: str) -> str:
    """A frame as ``file:line function``."""
    return f"{filename}:{lineno} {name}"


def classify_stack(frames: list[tuple[str, int, str]]) -> tuple[str, str | None, str | None]:
    """``(state, frame, waiting_in)`` of a stack given innermost first as (file, line,
    function). ``waiting``: the innermost frame (logging wrappers skipped) is a
    torch.distributed collective or the autograd engine's backward (DDP/FSDP gradient
    reduction), i.e. the rank waits for the others; anything else is ``stuck``."""
    if not frames:
        return "stuck", None, None
    frame = where(*frames[0])
    for filename, _line, name in frames:
        path = filename.replace(os.sep, "/")
        if any(w in path for w in _WRAPPERS):
            continue
        if "torch/distributed/" in path and (
            path.endswith("distributed_c10d.py") or name in _COLLECTIVES or "collective" in path
        ):
            return "waiting", frame, name
        if ("torch/autograd/" in path or path.endswith("torch/_tensor.py")) and (
            "backward" in name
        ):
            return "waiting", frame, "backward"
        return "stuck", frame, None
    return "stuck", frame, None


def thread_frames(ident: int) -> list[tuple[str, int, str]]:
    frame = sys._current_frames().get(ident)
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def decide(verdicts: Mapping[int, dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The culprits of a hang from the verdicts that arrived (rank -> verdict). A verdict
    of a rank outside ``range(world_size)`` is no rank of this job: never a culprit."""
    verdicts = {r: v for r, v in verdicts.items() if 0 <= r < world_size}
    missing = sorted(set(range(world_size)) - set(verdicts))
    stuck = sorted(r for r, v in verdicts.items() if v.get("state") != "waiting")
    if stuck or missing:
        culprits = sorted(set(stuck) | set(missing))
        cause = "no response" if not stuck else "not in a collective"
    else:  # everyone waits: a desync (some ranks behind) or the collective itself
        low = min(int(v.get("step") or 0) for v in verdicts.values())
        behind = sorted(r for r, v in verdicts.items() if int(v.get("step") or 0) == low)
        if len(behind) < len(verdicts):
            culprits, cause = behind, "behind the other ranks (desync)"
        else:
            culprits, cause = sorted(verdicts), "every rank waits in a collective"
    entries = []
    for r in culprits:
        v = verdicts.get(r)
        if v is None:
            entries.append({"rank": r, "node": None, "frame": None, "state": "no_response"})
        else:
            entries.append(
                {
                    "rank": r,
                    "node": v.get("node"),
                    "frame": v.get("frame"),
                    "state": v.get("state"),
                    "step": v.get("step"),
                    "stack": v.get("stack", []),  # innermost first: frame may be a library's
                }
            )
    return {"stuck_ranks": culprits, "stuck": entries, "cause": cause, "missing_ranks": missing}


def hang_dir(run_dir: str | os.PathLike[str], attempt: int) -> Path:
    return Path(run_dir) / HANGS_DIR / f"attempt-{attempt}"


def read_verdicts(
    d: Path,
    rejects: Rejects | None = None,
    *,
    nonce: str | None = None,
    world_size: int | None = None,
) -> dict[int, dict[str, Any]]:
    """The verdicts in hang dump directory ``d`` by rank. Each file goes through
    ``monitor/records.py``: a regular file of bounded size inside the run directory, holding
    an object with the fields ``hang_record`` reads (``VERDICT_FIELDS``) whose ``rank`` is
    the one its name says; with ``world_size``, a rank of that world; with ``nonce``, this
    run's (a verdict another run left, or anyone dropped there, is not this job's). Anything
    else is skipped with a warning naming it (and counted in ``rejects``): that rank counts
    as "no response", never a crash of the watchdog or of the next attempt's start-up."""
    out = {}
    root = d.parent.parent  # the run directory
    for path in sorted(d.glob("rank-*.json")):
        label = f"{HANGS_DIR}/{d.name}/{path.name}"
        v = read_json(path, root=root, rejects=rejects, label=label)
        if v is None:
            continue  # missing, or refused and logged by read_json
        why = "not a JSON object" if not isinstance(v, dict) else None
        why = why or check_fields(v, VERDICT_FIELDS, "hang verdict") or _foreign(v, path.name)
        if why is None and world_size is not None and v["rank"] >= world_size:
            why = f"rank {v['rank']} is not a rank of this job (world size {world_size})"
        if why is None and nonce is not None and v.get("nonce") != nonce:
            why = "another run's verdict (its nonce is not this run's)"
        if why is not None:
            if rejects is not None:  # warns (a few times per file) and counts
                rejects.add(label, why, str(path))
            else:
                log.warning("hang verdict %s unusable (%s): counted as no response", path, why)
            continue
        out[int(v["rank"])] = v
    return out


def read_stopped(d: Path, *, nonce: str | None, world_size: int) -> set[int]:
    """The ranks whose reaper published ``stopped-rank-{R}.json`` in ``d``: stopped, so no
    verdict of theirs will come (reaper.py). A note that is not this job's (another run's
    nonce, a rank outside the job, the wrong file name) is skipped: that rank is waited
    for as before, never decided on sooner."""
    out = set()
    for path in d.glob(STOPPED_NOTE.format(rank="*")):
        v = read_json(path, root=d.parent.parent, label=f"{HANGS_DIR}/{d.name}/{path.name}")
        if not isinstance(v, dict) or type(v.get("rank")) is not int:
            continue
        r = v["rank"]
        if path.name == STOPPED_NOTE.format(rank=r) and 0 <= r < world_size:
            if nonce is None or v.get("nonce") == nonce:
                out.add(r)
    return out


def _foreign(v: dict[str, Any], name: str) -> str | None:
    """Why verdict ``v`` does not belong in the file ``name``, or None."""
    if name != f"rank-{int(v['rank'])}.json":
        return f"rank {v['rank']} in the file {name}"
    if v.get("world_size") is not None and v["rank"] >= v["world_size"]:
        return f"rank {v['rank']} outside its own world size {v['world_size']}"
    return None


def publish_decision(
    d: Path, rank: int, attempt: int, decision: dict[str, Any], nonce: str = ""
) -> None:
    """Publish this rank's ``decide`` result as ``decision-{R}.json``: the reapers
    (reaper.py) read it to kill the silent ranks, since a stopped rank cannot exit itself.
    ``nonce``: the run's; a reaper acts only on a decision that carries its own."""
    doc = {
        "rank": rank,
        "attempt": attempt,
        "nonce": nonce,
        "t": time.time(),
        "stuck_ranks": decision["stuck_ranks"],
        "missing_ranks": decision["missing_ranks"],
        "cause": decision["cause"],
    }
    publish_bytes(str(d / DECISION.format(rank=rank)), json.dumps(doc))


def hang_record(
    attempt: int,
    verdicts: Mapping[int, dict[str, Any]],
    decision: dict[str, Any],
    world_size: int,
    *,
    recovered: bool,
    kill_t: float | None,
) -> dict[str, Any]:
    vs = [v for r, v in verdicts.items() if 0 <= r < world_size]
    first = decision["stuck"][0] if decision["stuck"] else {}
    detect_t = min((float(v["detect_t"]) for v in vs), default=time.time())
    phase, deadline_s, phase_rank = _fired(vs)
    return {
        "type": "hang",
        "t": detect_t,
        "attempt": attempt,
        "step": min((int(v.get("step") or 0) for v in vs), default=0),
        "phase": phase,
        "phase_rank": phase_rank,
        "stuck_ranks": decision["stuck_ranks"],
        "nodes": sorted({e["node"] for e in decision["stuck"] if e.get("node")}),
        "frame": first.get("frame"),
        "cause": decision["cause"],
        "stuck": decision["stuck"],
        "missing_ranks": decision["missing_ranks"],
        "world_size": world_size,
        "progress_t": min(_progress(vs), default=None),
        "detect_t": detect_t,
        "detect_s": max((float(v["since_progress_s"]) for v in vs), default=None),
        "deadline_s": deadline_s,
        "kill_t": kill_t,
        "dump_dir": f"{HANGS_DIR}/attempt-{attempt}",
        "recovered": recovered,
    }


def _fired(vs: list[dict[str, Any]]) -> tuple[Any, float | None, int | None]:
    """(phase, deadline_s, rank) of the deadline that fired: the declared phase of another
    rank that held the ranks (``held_by``, monitor/phases.py), the one that held longest;
    else the longest of the ranks' own deadlines."""
    held = [v["held_by"] for v in vs if isinstance(v.get("held_by"), dict)]
    held = [h for h in held if _num(h.get("until_t")) and _num(h.get("deadline_s"))]
    if held:
        h = max(held, key=lambda h: float(h["until_t"]))
        rank = h.get("rank") if isinstance(h.get("rank"), int) else None
        return h.get("phase"), float(h["deadline_s"]), rank
    if not vs:
        return None, None, None
    v = max(vs, key=lambda v: float(v["deadline_s"]))
    return v.get("phase"), float(v["deadline_s"]), int(v["rank"])


def _world(verdicts: Mapping[int, dict[str, Any]]) -> int:
    """The attempt's world size as its verdicts say it: the size most of them give (of
    equals, the smallest: a verdict claiming a larger world names no extra rank), else one
    past the highest rank that answered."""
    sizes = Counter(int(v["world_size"]) for v in verdicts.values() if v.get("world_size"))
    if not sizes:
        return max(verdicts) + 1
    return max(sizes, key=lambda w: (sizes[w], -w))


def _progress(vs: list[dict[str, Any]]) -> list[float]:
    """Every rank's last progress the verdicts know: their own, and that of a rank whose
    declared phase held them (a rank stopped inside it answers nothing itself)."""
    out = [float(v["progress_t"]) for v in vs]
    held = [v["held_by"] for v in vs if isinstance(v.get("held_by"), dict)]
    return out + [float(h["progress_t"]) for h in held if _num(h.get("progress_t"))]


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def recover_hang_records(
    run_dir: str | os.PathLike[str], meter: Any, nonce: str | None = None
) -> int:
    """Rank 0 at start-up: write the ``hang`` records an earlier attempt's rank 0 could not
    (it was stuck or stopped), from the verdict files, marked ``recovered``. Returns how
    many. ``recorded.json`` is published after the meter flushed, so each is written once
    (a crash in between, a window of milliseconds, could write one twice). ``nonce``: the
    run's; verdicts without it are not this run's and are skipped."""
    root = Path(run_dir) / HANGS_DIR
    if not root.is_dir() or not getattr(meter, "enabled", True):
        return 0
    n = 0
    for d in sorted(root.glob("attempt-*")):
        if (d / RECORDED).exists():
            continue
        verdicts = read_verdicts(d, nonce=nonce)
        if not verdicts:
            continue
        try:
            attempt = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        world = _world(verdicts)
        rec = hang_record(
            attempt, verdicts, decide(verdicts, world), world, recovered=True, kill_t=None
        )
        meter.event(rec)
        meter.flush()
        publish_bytes(str(d / RECORDED), json.dumps(rec))
        n += 1
    return n
