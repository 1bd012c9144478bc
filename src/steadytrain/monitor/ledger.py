"""The goodput ledger: one append-only JSON-lines file per run directory.

``RUN_DIR/ledger.jsonl`` holds one JSON object per line, each with a ``"type"`` key
(``job_start``, ``step``, ``checkpoint``, ``restore``, ``alert``, ``job_end``; see
docs/monitoring.md for the fields). Every attempt of a job (each restart after a failure)
appends to the same file, so the file alone tells where every second of the whole run went.

Durability: lines are handed to the OS after every batch (a crashed *process* loses at
most the records still queued in memory) and ``fsync``'d at every checkpoint commit and at
``job_end`` (a crashed *machine* loses at most the steps since the last checkpoint, which a
restart redoes anyway). A line cut short by a crash is skipped on read, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["LEDGER_NAME", "Ledger", "iter_ledger", "read_ledger", "next_attempt", "ledger_path"]

LEDGER_NAME = "ledger.jsonl"
RECORD_TYPES = ("job_start", "step", "checkpoint", "restore", "alert", "job_end")

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
    """Appends records to ``RUN_DIR/ledger.jsonl``; only the background writer calls it."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = ledger_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fix_torn_tail()
        # Append mode: restarts add to the history, never rewrite it.
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _fix_torn_tail(self) -> None:
        # A crash mid-write can leave a last line without its newline; start ours on a
        # fresh line so the torn record stays isolated (and skipped) instead of corrupting
        # the first record of this attempt.
        try:
            with open(self.path, "rb+") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        except FileNotFoundError:
            return

    def write(self, records: Iterable[dict[str, Any]], durable: bool = False) -> None:
        lines = [json.dumps(r, default=_default, separators=(",", ":")) for r in records]
        if lines:
            self._f.write("\n".join(lines) + "\n")
        self._f.flush()
        if durable:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


def iter_ledger(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a ledger file (or of ``RUN_DIR/ledger.jsonl``), in order.

    Lines that do not parse (the torn tail of a crashed writer) are skipped with a warning.
    """
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: skipping a torn ledger line (a crash mid-write)", p, n)
                continue
            if isinstance(rec, dict) and "type" in rec:
                yield rec


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_ledger(path))


def next_attempt(run_dir: str | os.PathLike[str]) -> int:
    """The number of the next attempt: 0 for a fresh run directory, else last + 1.

    Numbered from 0 like torchelastic's ``TORCHELASTIC_RESTART_COUNT``.
    """
    p = ledger_path(run_dir)
    if not p.exists():
        return 0
    last = -1
    for rec in iter_ledger(p):
        if rec.get("type") == "job_start":
            last = max(last, int(rec.get("attempt", last + 1)))
    return last + 1
