"""Reading back what a run wrote: the one validation layer for its records.

The ledger, the rank files, the hang verdicts and the snapshots are written by this run, an
earlier run, another process or a person, so a reader trusts none of them. Every reader of
those files goes through here:

* ``open_regular``: only a regular file is opened (never a FIFO, a device or a directory:
  reading one would hang or never end), and a symlink that leaves the run directory is not
  followed. Refusals are counted and logged with the file's name, never raised.
* ``iter_records``: JSON Lines read with a bounded ``readline`` (a line over ``MAX_LINE``
  bytes is skipped in chunks, never held in memory), nesting bounded before ``json.loads``
  recurses, and each record checked against its type's fields (``LEDGER_FIELDS``,
  ``RANK_FIELDS``): numbers finite, times and durations non-negative, steps and attempts
  integers below ``MAX_INT``, counts of ranks bounded. A bad record is skipped and counted
  by file and reason in a ``Rejects``; the report prints the counts (``rejected_records``).
* ``read_json``: a small JSON file (snapshot, hang verdict) with the same checks, or None.

docs/format.md ("What readers accept") is the contract this module implements.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from steadytrain.printable import printable
from steadytrain.storage.regular import NotRegularFileError, inside, open_regular_fd

__all__ = [
    "MAX_DEPTH",
    "MAX_INT",
    "MAX_LINE",
    "MAX_SECONDS",
    "MAX_WORLD",
    "LEDGER_FIELDS",
    "RANK_FIELDS",
    "PHASE_FIELDS",
    "VERDICT_FIELDS",
    "TRACE_FIELDS",
    "iter_trace",
    "Rejects",
    "check_record",
    "finite_tree",
    "iter_records",
    "open_regular",
    "parse_line",
    "read_json",
]

log = logging.getLogger("steadytrain.monitor")

MAX_LINE = 1 << 20  # bytes per JSON line (a real record is well under 10 KiB)
MAX_JSON_FILE = 16 << 20  # bytes of a snapshot or verdict file
MAX_DEPTH = 64  # nesting of a record (a real one has 4 levels)
MAX_INT = 2**53  # steps, attempts, tokens: beyond this a float no longer counts by one
MAX_SECONDS = 1e9  # a duration (31 years): more is a corrupt value, not a measurement
MAX_TIME = 1e11  # a Unix time (year 5138)
MAX_WORLD = 1 << 20  # ranks in a job: readers loop over range(world_size)
_MAX_BYTES = 2**63  # a byte count or counter ("nonneg")
_WARN_PER_FILE = 5  # warnings logged per file; the rest are only counted

# Field kinds: "time" (a Unix time), "dur" (seconds), "int" (a step, attempt, count),
# "world" (a number of ranks), "nonneg" (a finite number >= 0), "any_num" (a number),
# "str", "bool", "dict", "list", "ints" (a list of ints), "band" ([low, high or null]).
# A trailing "?" allows null; a leading "!" makes the field required.
_STEP_METRICS = {
    "compute_s": "dur?",
    "read_p99_s": "dur?",
    "read_s": "dur?",
    "rss_bytes": "nonneg?",
    "shm_bytes": "nonneg?",
    "bytes_read": "nonneg?",
    "cache_hits": "nonneg?",
    "cache_misses": "nonneg?",
    "loss": "any_num?",
}
LEDGER_FIELDS: dict[str, dict[str, str]] = {
    "job_start": {
        "t": "!time",
        "attempt": "int",
        "world_size": "world?",
        "restored_step": "int?",
        "startup_s": "dur?",
        "restore_s": "dur?",
        "config": "dict?",
        "expected_tokens_per_s": "band?",
        "device": "str?",
        "run_nonce": "str?",
        "total_steps": "int?",
        "restore_unknown": "bool?",
        "startup_phases": "dict?",  # startup_s in phases (run_phases.py), values checked on use
        "born_t": "time?",  # the process's birth
    },
    "step": {
        "t": "!time",
        "step": "!int",  # every reader indexes steps by it: a step record without one is refused
        "tokens": "int?",
        "step_s": "dur?",
        "data_wait_s": "dur?",
        "checkpoint_block_s": "dur?",
        "eval_s": "dur?",  # time inside declared eval phases since the previous step
        # written back at start-up (monitor/recovered.py); a summary stands for ``steps``
        "recovered": "bool?",
        "steps": "int?",
        **_STEP_METRICS,
    },
    "checkpoint": {
        "t": "time?",
        "step": "int?",
        "block_s": "dur?",
        "durable_s": "dur?",
        "ok": "bool?",
        "path": "str?",
        "error": "str?",
        "recovered": "bool?",  # written back at the next start (monitor/recovered.py)
    },
    # ``tier``: "local-memory", "peer-memory" or "durable" (issue 28); an older ledger's
    # restore has none and was a durable one. Bytes read from the node's own memory and
    # fetched from a peer's; a durable restore's bytes downloaded from the remote store.
    "restore": {
        "t": "time?",
        "step": "int?",
        "restore_s": "dur?",
        "tier": "str?",
        "bytes_local": "nonneg?",
        "bytes_peer": "nonneg?",
        "bytes_remote": "nonneg?",
        "skipped": "list?",  # what the restore passed over: [{"path", "step", "reason"}]
        "commit_t": "time?",  # the restored checkpoint's COMMIT wall_time
    },
    # One generation of the memory tier (checkpoint/memory/): the loop's blocking (staging,
    # and waiting for the previous generation), the background write and peer transfer.
    "memory_snapshot": {
        "t": "time?",
        "step": "int?",
        "ok": "bool?",
        "block_s": "dur?",
        "write_s": "dur?",
        "peer_s": "dur?",
        "bytes": "nonneg?",
        "peer_bytes": "nonneg?",
        "error": "str?",
    },
    "alert": {
        "t": "time?",
        "step": "int?",
        "kind": "str?",
        "message": "str?",
        "diagnosis": "str?",
        "next": "str?",
        "rank": "int?",
        "ranks": "ints?",
        "node": "str?",
        "evidence": "dict?",
    },
    # eval_s: an evaluation after the last step (no step record follows to carry it);
    # checkpoint_block_s: the closing wait for the final save and the one in flight
    "job_end": {
        "t": "time?",
        "step": "int?",
        "reason": "str?",
        "eval_s": "dur?",
        "checkpoint_block_s": "dur?",
    },
    "hang": {"t": "time?", "attempt": "int?", "step": "int?", "stuck_ranks": "ints?"},
    # one per in-place recovery or its fallback (run_inplace.recovery_record, issue 44)
    "inplace_recovery": {
        "t": "time?",
        "attempt": "int?",
        "path": "!str",  # "in_place" or "whole_restart"
        "failed_ranks": "ints?",
        "from_step": "int?",
        "step": "int?",
        "phases": "dict?",  # seconds, values checked on use
        "why": "str?",
        "fallback": "str?",
        "redo_done": "bool?",
    },
}
# Any other type (keys may be added, docs/format.md part E): only these common fields.
_COMMON = {"t": "time?", "step": "int?", "attempt": "int?"}
RANK_FIELDS: dict[str, dict[str, str]] = {
    "rank_start": {
        "t": "time?",
        "attempt": "int?",
        "rank": "int?",
        "node": "str?",
        "local_rank": "int?",
        "world_size": "world?",
        "device": "str?",
        "pid": "int?",
        "addrs": "list?",  # the host's IP addresses (ranks.host_addrs), optional
        "born_t": "time?",  # the process's birth (report/restarts.py)
    },
    "rank_step": {
        "step": "!int",
        "attempt": "int?",
        "t": "time?",
        "step_s": "dur?",
        "data_wait_s": "dur?",
        "between_next_s": "dur?",
        "forward_s": "dur?",
        "checkpoint_block_s": "dur?",
        "eval_s": "dur?",
        **_STEP_METRICS,
        # host signals (rank_recorder.HostSampler), sampled about once a second: runnable
        # tasks, usable cores, shares of the sample interval stolen / cgroup-throttled
        "host_run_queue": "nonneg?",
        "host_cpus": "nonneg?",
        "host_steal": "nonneg?",
        "host_throttled": "nonneg?",
    },
    "rank_end": {
        "t": "time?",
        "attempt": "int?",
        "step": "int?",
        "reason": "str?",
        "eval_s": "dur?",
    },
    "hang": LEDGER_FIELDS["hang"],
}
# A step trace line (RUN_DIR/trace-rank{R}.jsonl, train/support.py StepTrace): no "type";
# a line with one (a "records_lost" marker) is not a step and is passed over uncounted.
TRACE_FIELDS = {
    "step": "!int",
    "attempt": "int?",
    "rank": "int?",
    "world": "world?",
    "loss": "any_num?",
    "local_loss": "any_num?",
    "lr": "any_num?",
    "sample_ids": "ints?",
}
# A rank's hang verdict (hangs/attempt-A/rank-R.json): what hang_record reads from it.
VERDICT_FIELDS = {
    "rank": "!int",
    "world_size": "world?",
    "step": "int?",
    "detect_t": "!time",
    "progress_t": "!time",
    "since_progress_s": "!dur",
    "deadline_s": "!dur",
    "state": "str?",
    "node": "str?",
    "frame": "str?",
    "phase": "str?",
    "stack": "list?",
    "nonce": "str?",
    "held_by": "dict?",
}
# A rank's declared phase (hangs/phases/attempt-A/phase-rank-R.json, monitor/phases.py).
PHASE_FIELDS = {
    "rank": "!int",
    "attempt": "!int",
    "nonce": "!str",
    "phase": "!str",
    "state": "!str",
    "progress_t": "!time",
    "deadline_s": "!dur",
    "entered_t": "time?",
    "closed_t": "time?",
}


class Rejects:
    """Skipped records and files, counted by file (a name relative to the run directory)
    and reason: ``to_dict()`` is the report's ``rejected_records``."""

    def __init__(self, warn: bool = True) -> None:
        """``warn=False``: count only (a second reader of files another one already
        reported, e.g. the diagnosis engine inside ``build_report``)."""
        self.files: dict[str, dict[str, Any]] = {}
        self.warn = warn

    def add(self, file: str, reason: str, where: str | None = None) -> None:
        entry = self.files.setdefault(file, {"count": 0, "reasons": {}})
        entry["count"] += 1
        entry["reasons"][reason] = entry["reasons"].get(reason, 0) + 1
        if self.warn and entry["count"] <= _WARN_PER_FILE:
            log.warning(
                "%s: skipped (%s)%s",
                printable(where or file),  # a file name in a run directory: anyone's choice
                printable(reason),
                "; further ones are only counted" if entry["count"] == _WARN_PER_FILE else "",
            )

    @property
    def total(self) -> int:
        return sum(e["count"] for e in self.files.values())

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            f: {"count": e["count"], "reasons": dict(e["reasons"])}
            for f, e in sorted(self.files.items())
        }


def open_regular(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    rejects: Rejects | None = None,
    label: str | None = None,
) -> IO[bytes] | None:
    """``path`` opened for binary reading if it is a regular file (and, with ``root``, lies
    inside ``root`` once symlinks are resolved); else None, counted in ``rejects`` and
    logged naming the file. A missing file is None without a count. ``O_NONBLOCK``: opening
    a FIFO must not wait for a writer (the mode check then refuses it)."""
    p = Path(path)
    name = label or p.name

    def refuse(why: str, where: str | None = None) -> None:
        if rejects is not None:
            rejects.add(name, why, where or str(p))
        else:
            log.warning("%s: skipped (%s)", where or p, why)

    # Resolved, so a link anywhere on the way (the file or its directory) counts.
    if root is not None and not inside(p, root):
        refuse(
            "a symlink outside the run directory: replace it with the file itself",
            f"{p} -> {os.path.realpath(p)}",
        )
        return None
    try:
        fd = open_regular_fd(p)
    except FileNotFoundError:
        return None
    except NotRegularFileError as e:
        refuse(f"{e.kind}, not a regular file: remove it or put the file itself there")
        return None
    except OSError as e:
        refuse(f"cannot be opened: {e.strerror or e}")
        return None
    return os.fdopen(fd, "rb")


def _lines(f: IO[bytes], limit: int) -> Iterator[bytes | None]:
    """Each line of ``f`` (None for one longer than ``limit``: skipped in chunks, so memory
    stays O(limit) whatever the file holds)."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 16)
            yield None
            continue
        yield line


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def _too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when ``raw`` nests deeper than ``limit`` (checked before ``json.loads``, whose
    recursion a 100k-deep line would exhaust). Brackets inside strings do not count."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep
    depth = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


def parse_line(raw: bytes) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, reason)`` for one line's bytes."""
    if _too_deep(raw):
        return None, f"nested deeper than {MAX_DEPTH} levels"
    try:
        return json.loads(raw), None
    except RecursionError:
        return None, f"nested deeper than {MAX_DEPTH} levels"
    except ValueError:  # JSONDecodeError, or a torn multi-byte character
        return None, "not JSON (a torn line: a crash mid-write?)"


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(kind: str, v: Any) -> str | None:
    """None when ``v`` is a valid ``kind`` (without the markers), else what is wrong."""
    if kind == "any_num":  # a loss may legitimately be NaN (a diverged run)
        return None if _num(v) else "not a number"
    if kind in ("time", "dur", "nonneg", "int", "world"):
        if not _num(v):
            return "not a number"
        if isinstance(v, float) and not math.isfinite(v):
            return "not finite"
        if v < 0:
            return "negative"
        top = {"time": MAX_TIME, "dur": MAX_SECONDS, "int": MAX_INT, "world": MAX_WORLD}
        limit = top.get(kind, _MAX_BYTES)
        if v >= limit:
            return f"too large (>= {limit:g})"
        if kind in ("int", "world") and v != int(v):
            return "not an integer"
        if kind == "world" and v < 1:
            return "below 1"
        return None
    if kind == "str":
        return None if isinstance(v, str) else "not a string"
    if kind == "bool":
        return None if isinstance(v, bool) else "not true/false"
    if kind == "dict":
        return None if isinstance(v, dict) else "not an object"
    if kind == "list":
        return None if isinstance(v, list) else "not a list"
    if kind == "ints":
        ok = isinstance(v, list) and all(_check("int", x) is None for x in v)
        return None if ok else "not a list of non-negative integers"
    if kind == "band":
        ok = (
            isinstance(v, list)
            and len(v) == 2
            and _check("nonneg", v[0]) is None
            and (v[1] is None or _check("nonneg", v[1]) is None)
        )
        return None if ok else "not [low, high or null]"
    raise ValueError(f"unknown field kind {kind!r}")


def check_record(rec: Any, fields: dict[str, dict[str, str]] | None) -> str | None:
    """None when ``rec`` is a valid record (a dict with a string ``type`` whose fields have
    their kinds: ``fields`` per type, ``_COMMON`` for other types), else the reason."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    kind = rec.get("type")
    if not isinstance(kind, str):
        return 'no string "type"'
    spec = (fields or {}).get(kind, _COMMON)
    return check_fields(rec, spec, f"{kind!s:.40}")


def check_fields(rec: dict[str, Any], spec: dict[str, str], what: str) -> str | None:
    for key, kind in spec.items():
        required = kind.startswith("!")
        kind = kind.lstrip("!")
        nullable = kind.endswith("?")
        kind = kind.rstrip("?")
        if key not in rec:
            if required:
                return f"{what}: no {key!r}"
            continue
        v = rec[key]
        if v is None and nullable:
            continue
        why = _check(kind, v)
        if why is not None:
            return f"{what}: {key!r} {why}"
    return None


def iter_records(
    path: str | os.PathLike[str],
    fields: dict[str, Any] | None,
    *,
    offset: int = 0,
    root: str | os.PathLike[str] | None = None,
    rejects: Rejects | None = None,
    label: str | None = None,
    skipped: list[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """The valid records of a JSON-lines file from byte ``offset`` (a line boundary), in
    order. Everything else is skipped and counted in ``rejects`` under ``label`` (line
    numbers of lines that do not parse are appended to ``skipped``). Raises nothing for bad
    content; a file that is not a regular file yields nothing (counted)."""
    p = Path(path)
    name = label or p.name
    rejects = rejects if rejects is not None else Rejects()  # its warnings are capped per file
    check = (lambda r: check_record(r, fields)) if fields is not TRACE_FIELDS else _check_trace
    f = open_regular(p, root, rejects, name)
    if f is None:
        return
    with f:
        if offset:
            f.seek(offset)
        for n, raw in enumerate(_lines(f, MAX_LINE), 1):
            where = f"{p}:{n}" if not offset else f"{p}:+{offset}:{n}"
            if raw is None:
                why: str | None = f"line longer than {MAX_LINE} bytes"
                rec = None
            else:
                line = raw.strip()
                if not line:
                    continue
                rec, why = parse_line(line)
                if why is not None and skipped is not None:
                    skipped.append(n)
                if why is None:
                    why = check(rec)
                    if why == "":
                        continue  # not a record of this file's kind, not a bad one
            if why is not None:
                rejects.add(name, why, where)
                continue
            yield rec  # type: ignore[misc]


def _check_trace(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if "type" in rec:
        return ""  # a marker line (records_lost): no step
    return check_fields(rec, TRACE_FIELDS, "trace")


def iter_trace(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    rejects: Rejects | None = None,
) -> Iterator[dict[str, Any]]:
    """The step records of a step trace (``trace-rank{R}.jsonl``), checked like the ledger's
    (``TRACE_FIELDS``; marker lines with a ``type`` passed over)."""
    p = Path(path)
    yield from iter_records(
        p, TRACE_FIELDS, root=p.parent if root is None else root, rejects=rejects
    )


def read_json(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    rejects: Rejects | None = None,
    label: str | None = None,
) -> Any:
    """A small JSON file's value (at most ``MAX_JSON_FILE`` bytes, nesting bounded,
    regular file only), or None (missing, or refused and counted)."""
    p = Path(path)
    name = label or p.name
    f = open_regular(p, root, rejects, name)
    if f is None:
        return None
    with f:
        raw = f.read(MAX_JSON_FILE + 1)
    why = None
    if len(raw) > MAX_JSON_FILE:
        why = f"larger than {MAX_JSON_FILE} bytes"
    else:
        value, why = parse_line(raw)
    if why is not None:
        if rejects is not None:
            rejects.add(name, why, str(p))
        else:
            log.warning("%s: not used (%s)", p, why)
        return None
    return value


def finite_tree(v: Any, nonneg: bool = False, depth: int = 0) -> bool:
    """True when every number inside ``v`` is finite (and >= 0 with ``nonneg``): a
    snapshot with NaN, inf or a negative sum is not used (the file is read instead)."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return True
    if isinstance(v, int):  # no float() of it: a 400-digit int would overflow
        return abs(v) < _MAX_BYTES and (not nonneg or v >= 0)
    if isinstance(v, float):
        return math.isfinite(v) and (not nonneg or v >= 0)
    if isinstance(v, dict):
        return all(finite_tree(x, nonneg, depth + 1) for x in v.values())
    if isinstance(v, list):
        return all(finite_tree(x, nonneg, depth + 1) for x in v)
    return False
