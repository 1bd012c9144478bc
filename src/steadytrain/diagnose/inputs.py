"""What the engine reads: one run directory's records, loaded once, validated.

``load(run_dir)`` gathers everything the live wing wrote (monitor/): rank 0's ledger (step
records folded into compact columns, every other record kept whole), the rank files
(``RanksView``: per-rank step series, nodes, attempts), and the hang verdicts of every
attempt. Invalid records are skipped and counted in ``rejects`` (monitor/records.py), never
fatal: a diagnosis of a damaged run is still a diagnosis.

It is the one reader of a run's records: the report (report/build.py) passes ``visit`` to fold
the ledger's records in the same pass, and hands the same ``RunRecords`` to the engine, so
each file is read once and each skipped record is warned about once.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain.monitor.hangs import HANGS_DIR, read_verdicts
from steadytrain.monitor.ledger import iter_ledger, ledger_path
from steadytrain.monitor.ranks import RanksView, read_ranks
from steadytrain.monitor.records import Rejects, check_fields, read_json

__all__ = ["RunRecords", "StepColumns", "load"]

_ATTEMPT_DIR = re.compile(r"^attempt-(\d{1,9})$")


@dataclass
class StepColumns:
    """Rank 0's step records as columns (a long run has millions of steps); NaN where a
    record did not carry the field."""

    step: array = field(default_factory=lambda: array("q"))
    t: array = field(default_factory=lambda: array("d"))
    attempt: array = field(default_factory=lambda: array("i"))
    step_s: array = field(default_factory=lambda: array("d"))
    data_wait_s: array = field(default_factory=lambda: array("d"))
    checkpoint_block_s: array = field(default_factory=lambda: array("d"))
    loss: array = field(default_factory=lambda: array("d"))

    def add(self, rec: dict[str, Any], attempt: int) -> None:
        nan = float("nan")
        self.step.append(int(rec["step"]))
        self.t.append(float(rec["t"]))
        self.attempt.append(attempt)
        for name in ("step_s", "data_wait_s", "checkpoint_block_s", "loss"):
            v = rec.get(name)
            getattr(self, name).append(nan if v is None else float(v))

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class RunRecords:
    """Everything one run directory recorded, as the engine's detectors read it."""

    run_dir: Path
    # rank 0's ledger without its step records, in order (job_start, job_end, checkpoint,
    # restore, alert, hang, records_lost, ...): each a validated dict
    events: list[dict[str, Any]]
    steps: StepColumns
    view: RanksView
    # attempt -> rank -> hang verdict (monitor/hangs.py), for every attempt that dumped
    verdicts: dict[int, dict[int, dict[str, Any]]]
    rejects: Rejects
    # attempt -> rank -> what the node-local reaper published when it killed a stuck rank
    # (hangs/attempt-A/reaped-rank-R.json: rank, node, pid, proc_state, signal, t)
    reaped: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)

    @property
    def starts(self) -> list[dict[str, Any]]:
        """The ``job_start`` records, one per attempt, oldest first."""
        return [e for e in self.events if e.get("type") == "job_start"]

    def ends(self) -> dict[int, dict[str, Any]]:
        """Attempt index (0-based, in ledger order) -> its ``job_end`` record."""
        out: dict[int, dict[str, Any]] = {}
        attempt = -1
        for e in self.events:
            if e.get("type") == "job_start":
                attempt += 1
            elif e.get("type") == "job_end" and attempt >= 0:
                out[attempt] = e
        return out

    @property
    def device(self) -> str | None:
        return next((s.get("device") for s in reversed(self.starts) if s.get("device")), None)

    def nodes_of(self, ranks: list[int], step: int | None = None) -> list[str]:
        """The nodes ``ranks`` ran on (at ``step`` when given), from the rank files."""
        out: list[str] = []
        for r in ranks:
            s = self.view.ranks.get(r)
            node = None if s is None else (s.node_at(step) if step is not None else s.node)
            if node is not None and node not in out:
                out.append(node)
        return out


def load(
    run_dir: str | os.PathLike[str],
    rejects: Rejects | None = None,
    visit: Callable[[dict[str, Any]], None] | None = None,
) -> RunRecords:
    """Read ``run_dir``'s records once; ``visit`` is called with every valid ledger record,
    in order, as it is read. A missing ledger gives empty events (the caller, e.g. the
    report, decides whether that is an error)."""
    run = Path(run_dir)
    rejects = rejects if rejects is not None else Rejects()
    events: list[dict[str, Any]] = []
    steps = StepColumns()
    attempt = -1
    path = ledger_path(run)
    expected: dict[int, int] = {}
    per_rank = True
    if path.exists():
        for rec in iter_ledger(path, rejects=rejects):
            if visit is not None:
                visit(rec)
            kind = rec["type"]
            if kind == "step":
                steps.add(rec, attempt)
                continue
            if kind == "job_start":
                attempt += 1
                expected[int(rec.get("attempt", attempt))] = int(rec.get("world_size") or 1)
                per_rank = per_rank and _writes_rank_files(rec)
            events.append(rec)
    # A run that chose not to write rank files (monitor.per_rank = false) misses none.
    view = read_ranks(run, (expected or None) if per_rank else None, rejects)
    verdicts: dict[int, dict[int, dict[str, Any]]] = {}
    reaped: dict[int, dict[int, dict[str, Any]]] = {}
    hangs = run / HANGS_DIR
    if hangs.is_dir():
        for d in sorted(hangs.iterdir()):
            m = _ATTEMPT_DIR.match(d.name)
            if m and d.is_dir() and not d.is_symlink():
                got = read_verdicts(d, rejects)
                if got:
                    verdicts[int(m.group(1))] = got
                killed = read_reaped(d, rejects)
                if killed:
                    reaped[int(m.group(1))] = killed
    return RunRecords(run, events, steps, view, verdicts, rejects, reaped)


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _writes_rank_files(start: dict[str, Any]) -> bool:
    """False where a job_start's config turned the rank files off (``monitor.per_rank``)."""
    return _obj(_obj(start.get("config")).get("monitor")).get("per_rank") is not False


# A reaper file's fields (the REAPER side writes them; see read_reaped).
REAPED_FIELDS = {
    "rank": "!int",
    "node": "str?",
    "pid": "int?",
    "proc_state": "str?",
    "proc_state_name": "str?",
    "signal": "str?",
    "t": "time?",
}


def read_reaped(d: Path, rejects: Rejects | None = None) -> dict[int, dict[str, Any]]:
    """rank -> the reaper's record in hang dump directory ``d``
    (``reaped-rank-R.json``); files that are not such a record are skipped and counted."""
    out: dict[int, dict[str, Any]] = {}
    root = d.parent.parent  # the run directory
    for path in sorted(d.glob("reaped-rank-*.json")):
        label = f"{HANGS_DIR}/{d.name}/{path.name}"
        v = read_json(path, root=root, rejects=rejects, label=label)
        if v is None:
            continue
        why = "not a JSON object" if not isinstance(v, dict) else None
        why = why or check_fields(v, REAPED_FIELDS, "reaper record")
        if why is not None:
            if rejects is not None:
                rejects.add(label, why, str(path))
            continue
        out[int(v["rank"])] = v
    return out
