"""The goodput ledger: one append-only JSON-lines file per run directory.

``RUN_DIR/ledger.jsonl`` holds one JSON object per line, each with a ``"type"`` key
(``job_start``, ``step``, ``checkpoint``, ``restore``, ``memory_snapshot``, ``alert``,
``job_end``; see docs/monitoring.md for the fields). Every attempt of a job (each restart
after a failure) appends to the same file, so the file alone tells where every second of the
whole run went.

Durability: lines are handed to the OS after every batch (a crashed *process* loses at
most the records still queued in memory) and ``fsync``'d at every checkpoint commit and at
``job_end`` (a crashed *machine* loses at most the steps since the last checkpoint, which a
restart redoes anyway); the first fsync also syncs the run directory, so a new ledger's
name lasts as long as its lines. A line cut short by a crash is skipped on read, never fatal.

Restart snapshot: ``RUN_DIR/ledger.snapshot.json`` (written by the meter, atomically) holds
the goodput accumulator's state as of a byte offset of the ledger, so a restarting meter
reads only the records after that offset (start-up cost independent of the run's length).
The snapshot records the ledger's inode and the last bytes before the offset; a replaced,
truncated or rewritten ledger fails that check and the reader falls back to the whole file.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from steadytrain.monitor.appender import Appender
from steadytrain.monitor.records import LEDGER_FIELDS, Rejects, iter_records, read_json
from steadytrain.storage.publish import atomic_writer

__all__ = [
    "step_record",
    "LEDGER_NAME",
    "SNAPSHOT_NAME",
    "Ledger",
    "iter_ledger",
    "read_ledger",
    "next_attempt",
    "ledger_path",
    "snapshot_path",
    "write_snapshot",
    "load_snapshot",
    "write_snapshot_of",
    "load_snapshot_of",
]

LEDGER_NAME = "ledger.jsonl"
SNAPSHOT_NAME = "ledger.snapshot.json"
SNAPSHOT_VERSION = 1
_TAIL_BYTES = 64  # bytes before the offset kept in the snapshot to recognise the ledger
RECORD_TYPES = (
    "job_start",
    "step",
    "checkpoint",
    "restore",  # with its tier: local-memory, peer-memory or durable (issue 28)
    "memory_snapshot",  # one generation of the memory tier (checkpoint/memory/)
    "alert",
    "hang",
    "job_end",
    "records_lost",  # lines the writer had to drop while the disk failed (monitor/appender.py)
)

log = logging.getLogger("steadytrain.monitor")


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LEDGER_NAME


def _default(obj: Any) -> Any:
    # Tensors and numpy scalars reach the ledger through **extra; store their value.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


class Ledger:
    """Appends records to ``RUN_DIR/ledger.jsonl``; only the background writer calls it.

    It never raises ``OSError``: a full, read-only or failing disk, or a symlink, FIFO or
    device in the file's place, queues the records in a bounded buffer that is written when
    the file works again, and the lines dropped past that bound leave one ``records_lost``
    record (``monitor/appender.py``; docs/operations.md, "The run directory's disk fills").
    ``ok`` is False while records wait or after any were dropped: a snapshot of the reader's
    state must not be taken then (it would count records the file does not hold)."""

    def __init__(
        self, run_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None
    ) -> None:
        # ``path``: another append-only file of the run (a rank's own ledger, monitor/ranks.py)
        self.path = Path(path) if path is not None else ledger_path(run_dir)
        # Append only (O_APPEND, never through a symlink): restarts add to the history.
        self._out = Appender(self.path, self.path.name, default=_default)

    @property
    def ok(self) -> bool:
        return self._out.ok

    @property
    def pending(self) -> int:
        return self._out.pending

    @property
    def dropped(self) -> int:
        return self._out.dropped

    def write(self, records: Iterable[dict[str, Any]], durable: bool = False) -> bool:
        """Write ``records`` (and any that waited); ``durable``: fsync too. True when every
        record so far is in the file (and synced, when asked)."""
        done = self._out.append(records)
        if durable:
            done = self._out.sync() and done
        return done

    def offset(self) -> int:
        """Bytes written so far (the file is only ever appended to, by this writer)."""
        return self._out.offset()

    def sync(self) -> bool:
        return self._out.sync()

    def close(self) -> None:
        self._out.close()


def iter_ledger(
    path: str | os.PathLike[str],
    offset: int = 0,
    skipped: list[int] | None = None,
    *,
    rejects: Rejects | None = None,
    fields: dict[str, dict[str, str]] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the valid records of a ledger file (or of ``RUN_DIR/ledger.jsonl``), in order,
    starting at byte ``offset`` (a line boundary).

    Every line goes through ``monitor/records.py``: a line that does not parse (the torn
    tail of a crashed writer), is too long or too deeply nested, or a record whose fields
    have the wrong types or non-finite / negative / out-of-range numbers (``fields``: per
    record type, default ``LEDGER_FIELDS``) is skipped with a warning, counted in
    ``rejects`` by file and reason, and (when it does not parse) its line number appended
    to ``skipped``. A ledger that is not a regular file (a FIFO, a device) or a symlink
    leaving ``root`` (default: the file's directory) yields nothing. Never raises for what
    the file holds.
    """
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    label = f"{p.parent.name}/{p.name}" if p.parent.name == "ranks" else p.name
    yield from iter_records(
        p,
        LEDGER_FIELDS if fields is None else fields,
        offset=offset,
        root=p.parent if root is None else root,
        rejects=rejects,
        label=label,
        skipped=skipped,
    )


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_ledger(path))


def next_attempt(run_dir: str | os.PathLike[str]) -> int:
    """The number of the next attempt: 0 for a fresh run directory, else last + 1.

    Numbered from 0 like torchelastic's ``TORCHELASTIC_RESTART_COUNT``. A ``job_start``
    whose ``attempt`` is not a valid integer is skipped by the reader (never fatal).
    """
    p = ledger_path(run_dir)
    if not p.exists():
        return 0
    last = -1
    for rec in iter_ledger(p):
        if rec.get("type") == "job_start":
            last = max(last, int(rec.get("attempt", last + 1)))
    return last + 1


def snapshot_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / SNAPSHOT_NAME


def write_snapshot(run_dir: str | os.PathLike[str], offset: int, state: dict[str, Any]) -> None:
    """Publish ``state`` as of ledger byte ``offset`` atomically and durably
    (``storage.publish``). The caller has made the ledger durable up to ``offset`` first."""
    write_snapshot_of(ledger_path(run_dir), snapshot_path(run_dir), offset, state)


def write_snapshot_of(
    lp: str | os.PathLike[str], sp: str | os.PathLike[str], offset: int, state: dict[str, Any]
) -> None:
    """``write_snapshot`` for any append-only file ``lp`` and its snapshot ``sp``."""
    st = os.stat(lp)
    with open(lp, "rb") as f:
        f.seek(max(0, offset - _TAIL_BYTES))
        tail = f.read(offset - max(0, offset - _TAIL_BYTES))
    doc = {
        "version": SNAPSHOT_VERSION,
        "ledger": {"offset": offset, "inode": st.st_ino, "dev": st.st_dev, "tail": tail.hex()},
        **state,
    }
    with atomic_writer(str(sp), "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def load_snapshot(run_dir: str | os.PathLike[str]) -> tuple[int, dict[str, Any]] | None:
    """``(offset, snapshot)`` when ``RUN_DIR/ledger.snapshot.json`` exists, parses and still
    describes ``RUN_DIR/ledger.jsonl`` (same inode, at least ``offset`` bytes, the same bytes
    just before ``offset``); else ``None`` (the reason at debug level): read the whole file."""
    return load_snapshot_of(ledger_path(run_dir), snapshot_path(run_dir))


def load_snapshot_of(
    lp: str | os.PathLike[str], sp: str | os.PathLike[str]
) -> tuple[int, dict[str, Any]] | None:
    """``load_snapshot`` for any append-only file ``lp`` and its snapshot ``sp``."""
    path, lp = Path(sp), Path(lp)
    why = None
    try:
        # Bounded, regular files only (records.py): a FIFO or a huge file is not a snapshot.
        doc = read_json(path, root=path.parent)
        if doc is None:
            raise FileNotFoundError(path)
        meta = doc["ledger"]
        offset, tail = int(meta["offset"]), bytes.fromhex(meta["tail"])
        st = os.stat(lp)
        if not stat.S_ISREG(st.st_mode):
            why = "the ledger is not a regular file"
        elif offset < 0:
            why = f"negative offset {offset}"
        elif doc.get("version") != SNAPSHOT_VERSION:
            why = f"version {doc.get('version')!r}"
        elif (st.st_ino, st.st_dev) != (meta["inode"], meta["dev"]):
            why = "the ledger was replaced (inode changed)"
        elif st.st_size < offset or len(tail) != min(offset, _TAIL_BYTES):
            why = f"the ledger is shorter ({st.st_size} bytes) than the snapshot ({offset})"
        else:
            with open(lp, "rb") as f:
                f.seek(offset - len(tail))
                if f.read(len(tail)) != tail:
                    why = "the ledger's bytes before the snapshot offset changed"
    except FileNotFoundError:
        why = "no snapshot" if not path.exists() else "no ledger"
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        why = f"unreadable snapshot ({type(e).__name__}: {e})"
    if why is not None:
        log.debug("%s not used (%s): reading the whole ledger", path, why)
        return None
    return offset, doc


def step_record(
    t: float,
    step: int,
    tokens: int,
    step_s: float,
    data_wait_s: float,
    compute_s: float | None,
    checkpoint_block_s: float,
    loss: float | None,
    eval_s: float = 0.0,
) -> dict[str, Any]:
    """The ledger's ``step`` record (docs/format.md, part E): the one place it is built."""
    return {
        "type": "step",
        "t": t,
        "step": step,
        "tokens": tokens,
        "step_s": step_s,
        "data_wait_s": data_wait_s,
        "compute_s": compute_s,
        "checkpoint_block_s": checkpoint_block_s,
        "eval_s": eval_s,
        "loss": loss,
    }
