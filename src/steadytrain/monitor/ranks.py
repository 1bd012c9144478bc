"""Every rank's own ledger: ``RUN_DIR/ranks/rank-RRRRR.jsonl``, and the reader that merges them.

Rank 0's ``ledger.jsonl`` says where the job's time went; it cannot say *which* rank made
the others wait. So every rank appends a compact record per step to its own file (no
collective on the hot path, no cross-node traffic: the files meet in the run directory,
which a multi-node job keeps on shared storage like its checkpoints' metadata):

    {"type": "rank_start", "attempt": 2, "rank": 3, "node": "n1", "local_rank": 1,
     "world_size": 4, "device": "cpu", "pid": 812, "t": ...}
    {"type": "rank_step", "step": 41, "attempt": 2, "t": ..., "step_s": 0.21,
     "data_wait_s": 0.003, "between_next_s": 0.2, "compute_s": 0.2, "forward_s": 0.05,
     "checkpoint_block_s": 0.0, "read_p99_s": 0.001, "bytes_read": 9216,
     "cache_hits": 1, "cache_misses": 0, "rss_bytes": ..., "shm_bytes": ...}
    {"type": "rank_end", "attempt": 2, "step": 60, "reason": "finished", "t": ...}

Ranks are aligned by **step index**, never by the wall clocks in ``t`` (nodes' clocks
differ). A reader folds each file into a ``RankSummary``: totals, a read-time histogram and
a ``StepSeries`` of at most ``MAX_BINS`` step bins (bins double in width as the run grows),
so its memory is flat in the run's length. The summary is snapshotted next to the file
(``rank-RRRRR.snapshot.json``, same checks as the ledger's snapshot) every
``snapshot_every`` records, so ``steadytrain report`` reads only each file's tail: its time
is flat in the number of steps and linear in the number of ranks.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain.monitor.ledger import (
    Ledger,
    load_snapshot_of,
    write_snapshot_of,
)
from steadytrain.monitor.rank_summary import RANK_KEYS, RankSummary, StepSeries
from steadytrain.monitor.records import RANK_FIELDS, Rejects, iter_records
from steadytrain.node import node_name

__all__ = [
    "RANKS_DIR",
    "RANK_KEYS",
    "host_addrs",
    "node_name",
    "rank_path",
    "rank_snapshot_path",
    "rank_step_record",
    "rank_files",
    "RankFile",
    "RankSummary",
    "StepSeries",
    "RanksView",
    "read_ranks",
]

RANKS_DIR = "ranks"
MAX_MISSING = 1000  # rows of missing ranks listed (the rest are not enumerated)
_FILE_RE = re.compile(r"^rank-(\d+)\.jsonl$")


def host_addrs(limit: int = 16) -> list[str]:
    """This host's non-loopback IP addresses (``rank_start``'s ``addrs``), so a reader maps
    the peer address in a collective's error ("Connection closed by peer [10.0.0.2]:...")
    to a node name. Best effort: ``[]`` when the interfaces cannot be listed."""
    out: list[str] = []
    try:
        import psutil

        for snics in psutil.net_if_addrs().values():
            for a in snics:
                if a.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                addr = str(a.address).split("%", 1)[0]  # fe80::1%eth0: no zone
                if addr.startswith("127.") or addr == "::1" or addr in out:
                    continue
                out.append(addr)
    except Exception:  # noqa: BLE001 - a missing address costs a node name, never the run
        return out[:limit]
    return out[:limit]


def rank_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank-{rank:05d}.jsonl"


def rank_snapshot_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank-{rank:05d}.snapshot.json"


def rank_step_record(rec: dict[str, Any], attempt: int) -> dict[str, Any]:
    """A ``rank_step`` record from the meter's step record (plus the loader's metrics)."""
    out: dict[str, Any] = {"type": "rank_step", "step": rec["step"], "attempt": attempt}
    out["t"] = rec.get("t")
    for k in RANK_KEYS:
        v = rec.get(k)
        if v is not None:
            out[k] = v
    return out


class RankFile:
    """Appends one rank's records (only the meter's background thread calls it) and keeps
    its summary current, snapshotting it every ``snapshot_every`` records."""

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, snapshot_every: int = 1000
    ) -> None:
        self.run_dir, self.rank = Path(run_dir), rank
        self.path = rank_path(run_dir, rank)
        self.snapshot_every = snapshot_every
        self._ledger = Ledger(run_dir, self.path)
        self.summary, _, self.torn = _load_summary(self.path, rank)
        self._since = 0

    def write(self, records: list[dict[str, Any]], durable: bool = False) -> None:
        self._ledger.write(records, durable=durable)
        for rec in records:
            self.summary.add(rec)
        self._since += len(records)
        due = self._since >= self.snapshot_every or (durable and self._since)
        # Not while records wait for the disk or after some were dropped (the summary holds
        # them, the file does not), nor unsynced: a snapshot never covers bytes a crash
        # can lose. A failed snapshot costs a reader time, never this rank's records.
        if due and self._ledger.ok and self._ledger.sync():
            try:
                write_snapshot_of(
                    self.path,
                    rank_snapshot_path(self.run_dir, self.rank),
                    self._ledger.offset(),
                    {"summary": self.summary.state_dict()},
                )
                self._since = 0
            except OSError as e:  # the disk is full again: the next one is tried later
                import logging

                logging.getLogger("steadytrain.monitor").debug("%s: no snapshot: %s", self.path, e)

    def close(self) -> None:
        self._ledger.close()


def _load_summary(
    path: Path, rank: int, rejects: Rejects | None = None
) -> tuple[RankSummary, int, int]:
    """(summary, records replayed, torn lines skipped): the snapshot plus the file's tail,
    or the whole file when there is no usable snapshot. Invalid records (and a file that is
    not a regular one, or a symlink out of the run directory) are skipped and counted in
    ``rejects`` (monitor/records.py): never fatal."""
    summary, offset = RankSummary(rank=rank), 0
    if not os.path.lexists(path):
        return summary, 0, 0
    snap = None
    if path.is_file() and not path.is_symlink():  # a FIFO or a device has no snapshot
        snap = load_snapshot_of(path, path.with_name(path.name.replace(".jsonl", ".snapshot.json")))
    if snap is not None:
        try:
            summary = RankSummary.from_state_dict(snap[1]["summary"])
            offset = snap[0]
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
            summary, offset = RankSummary(rank=rank), 0
    torn: list[int] = []
    n = 0
    root = path.parent.parent  # the run directory
    label = f"{RANKS_DIR}/{path.name}"
    for rec in iter_records(
        path, RANK_FIELDS, offset=offset, root=root, rejects=rejects, label=label, skipped=torn
    ):
        summary.add(rec)
        n += 1
    return summary, n, len(torn)


@dataclass
class RanksView:
    """What the rank files of one run directory say, merged."""

    ranks: dict[int, RankSummary]
    torn_lines: int = 0  # lines skipped (a rank killed mid-write)
    missing: list[dict[str, Any]] = field(default_factory=list)  # ranks with no file/attempt
    # Records and files skipped as invalid, by file and reason (monitor/records.py).
    rejects: Rejects = field(default_factory=Rejects)

    def rows(self) -> list[dict[str, Any]]:
        return [self.ranks[r].row() for r in sorted(self.ranks)]

    def grid_width(self) -> int:
        """One bin width every rank's series can be re-binned to (the widest)."""
        return max((s.series.width for s in self.ranks.values()), default=1)

    def aligned(self) -> tuple[int, dict[int, dict[int, dict[str, float]]]]:
        """``(width, {rank: {bin: fields}})`` on one step grid (bin b covers steps
        ``b*width+1 .. (b+1)*width``)."""
        width = self.grid_width()
        return width, {r: s.series.rebin(width) for r, s in sorted(self.ranks.items())}


def rank_files(run_dir: str | os.PathLike[str]) -> Iterator[tuple[int, Path]]:
    d = Path(run_dir) / RANKS_DIR
    if not d.is_dir():
        return
    for p in sorted(d.iterdir()):
        m = _FILE_RE.match(p.name)
        if m:
            yield int(m.group(1)), p


def read_ranks(
    run_dir: str | os.PathLike[str],
    expected: dict[int, int] | None = None,
    rejects: Rejects | None = None,
) -> RanksView:
    """Fold every rank file of ``run_dir``. ``expected``: ``{attempt: world_size}`` from
    the main ledger's ``job_start`` records; a rank of an attempt with no ``rank_start``
    for it (its node never came back, or the run directory is not shared) is listed in
    ``missing``, never fatal."""
    view = RanksView(ranks={})
    if rejects is not None:
        view.rejects = rejects
    for rank, path in rank_files(run_dir):
        summary, _, torn = _load_summary(path, rank, view.rejects)
        view.ranks[rank] = summary
        view.torn_lines += torn
    for attempt, world in sorted((expected or {}).items()):
        if len(view.missing) >= MAX_MISSING:
            break  # a ledger claiming a million ranks must not make a million rows
        for r in range(min(int(world), MAX_MISSING)):
            s = view.ranks.get(r)
            if s is None:
                view.missing.append({"rank": r, "attempt": attempt, "reason": "no rank file"})
            elif s.attempts and not any(a.get("attempt") == attempt for a in s.attempts):
                view.missing.append(
                    {"rank": r, "attempt": attempt, "reason": "no records for this attempt"}
                )
    return view
