"""The per-rank ledger in a running job: this rank's recorder, and rank 0's poller.

``RankRecorder`` turns the meter's records (``step``, ``job_start``, ``job_end``, ``hang``)
into this rank's ``rank_*`` records and appends them to its file (monitor/ranks.py); it runs
on the meter's background thread. ``RankPoller`` is rank 0's live view of every rank: every
``every_s`` it reads the rank files' new lines (``RankTail``) and hands them to consumers
-- the straggler check (monitor/straggler_live.py) and the per-rank MLflow windows
(``rank_windows``) -- which may return ledger records (alerts) for the meter to add.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain.monitor.appender import open_regular
from steadytrain.monitor.cgroup import cpu_quota, own_cpu_cgroup, read_text, throttled_s
from steadytrain.monitor.ranks import (
    RankFile,
    host_addrs,
    node_name,
    rank_files,
    rank_step_record,
)

__all__ = ["HostSampler", "RankRecorder", "RankPoller", "RankTail", "rank_windows", "Consumer"]

log = logging.getLogger("steadytrain.monitor")

# (new records by rank) -> ledger records to add (e.g. alerts)
Consumer = Callable[[dict[int, list[dict[str, Any]]]], list[dict[str, Any]]]


def _usable_cpus(quota: float | None) -> int:
    """Cores this process may use: its affinity, capped by its cgroup's CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    if quota is not None and quota > 0:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


class HostSampler:
    """The host's CPU pressure, sampled at most once per ``every_s`` (cheap: a few small
    /proc and cgroup reads): ``host_run_queue`` (runnable tasks, /proc/loadavg, less the
    sampling thread itself), ``host_cpus`` (usable cores), ``host_steal`` (share of CPU
    time the hypervisor stole since the last sample) and ``host_throttled`` (share of the
    interval this process's own cgroup, or an ancestor's, was throttled: monitor/cgroup.py,
    from ``/proc/self/cgroup``, so a job's quota counts, not the machine root's). A signal
    that cannot be read is left out: the diagnosis then treats the host as unknown, never
    as idle. The cgroup and its quota are found again at every sample: a process can be
    moved to another cgroup, and a quota changed, while it runs. ``proc`` and
    ``cgroup_root`` stand for ``/proc`` and ``/sys/fs/cgroup`` (tests pass a fake tree)."""

    def __init__(
        self, every_s: float = 1.0, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup"
    ) -> None:
        self.every_s = every_s
        self.proc, self.cgroup_root = proc, cgroup_root
        self._due = 0.0
        self._stat: tuple[float, float] | None = self._cpu_stat()
        self._thr: tuple[float, dict[str, float]] = self._throttled()
        self.last: dict[str, float] = {}

    def _cpu_stat(self) -> tuple[float, float] | None:
        """(total, steal) jiffies of all CPUs from /proc/stat."""
        text = read_text(os.path.join(self.proc, "stat"))
        if not text or not text.startswith("cpu "):
            return None
        try:
            v = [float(x) for x in text.split("\n", 1)[0].split()[1:]]
        except ValueError:
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        return sum(v[:8]), (v[7] if len(v) > 7 else 0.0)

    def _throttled(self) -> tuple[float, dict[str, float]]:
        """(monotonic s, {cgroup dir: throttled s}) of this process's cgroup and its
        ancestors (empty where none is readable); sets ``cgroup``, ``quota`` and ``cpus``."""
        self.cgroup = own_cpu_cgroup(self.proc, self.cgroup_root)
        self.quota = cpu_quota(self.cgroup)  # cores, or None
        self.cpus = _usable_cpus(self.quota)
        return time.monotonic(), throttled_s(self.cgroup)

    def sample(self) -> dict[str, float]:
        """The newest sample (taken now when the last is ``every_s`` old)."""
        now = time.monotonic()
        if now < self._due and self.last:
            return self.last
        self._due = now + self.every_s
        thr = self._throttled()
        out: dict[str, float] = {"host_cpus": float(self.cpus)}
        text = read_text(os.path.join(self.proc, "loadavg"))  # "0.5 0.4 0.3 3/145 6555": 3 runnable
        if text:
            with contextlib.suppress(ValueError, IndexError):
                out["host_run_queue"] = max(0.0, float(text.split()[3].split("/")[0]) - 1)
        stat = self._cpu_stat()
        if stat is not None and self._stat is not None and stat[0] > self._stat[0]:
            out["host_steal"] = max(0.0, (stat[1] - self._stat[1]) / (stat[0] - self._stat[0]))
        self._stat = stat or self._stat
        # The largest share over the cgroup and its ancestors (a quota anywhere above this
        # process stops it when that cgroup runs out); a directory new since the last
        # sample (the process was moved) counts from the next one.
        shares = [
            (v - self._thr[1][d]) / (thr[0] - self._thr[0])
            for d, v in thr[1].items()
            if d in self._thr[1] and thr[0] > self._thr[0]
        ]
        if shares:
            out["host_throttled"] = min(1.0, max(0.0, max(shares)))
        self._thr = thr
        self.last = out
        return out


class RankRecorder:
    """This rank's own file: ``open``/``write``/``close`` run on the meter's thread."""

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, world_size: int, snapshot_every: int
    ) -> None:
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.snapshot_every = snapshot_every
        self.node = node_name()
        self.attempt = 0  # set by the meter at job_start
        self.born_t: float | None = None  # this process's birth, set by the meter at job_start
        self._file: RankFile | None = None
        self._host: HostSampler | None = None  # made on the meter's thread, at first use

    def start_record(self, t: float, device: str | None) -> dict[str, Any]:
        return {
            "type": "rank_start",
            "t": t,
            "attempt": self.attempt,
            "rank": self.rank,
            "node": self.node,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "world_size": self.world_size,
            "device": device,
            "pid": os.getpid(),
            "addrs": self._addrs(),
            # this process's birth (Run's): the report's restart phases (report/restarts.py)
            **({"born_t": float(self.born_t)} if self.born_t is not None else {}),
        }

    def _addrs(self) -> list[str]:
        """The host's addresses, listed once (a restart is a new process: listed again)."""
        if not hasattr(self, "_host_addrs"):
            self._host_addrs = host_addrs()
        return self._host_addrs

    def open(self) -> None:
        try:
            self._file = RankFile(self.run_dir, self.rank, self.snapshot_every)
        except Exception:
            log.exception("rank %d: its rank file could not open; not recording it", self.rank)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _convert(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for rec in batch:
            kind = rec.get("type")
            if kind == "step":
                if self._host is None:
                    self._host = HostSampler()
                out.append({**rank_step_record(rec, self.attempt), **self._host.sample()})
            elif kind == "job_start":  # rank 0's ledger record: its rank file gets its own
                out.append(self.start_record(rec["t"], rec.get("device")))
            elif kind in ("rank_start", "hang"):
                out.append(rec)
            elif kind == "job_end":
                out.append({**rec, "type": "rank_end", "attempt": self.attempt})
        return out

    def write(self, batch: list[dict[str, Any]]) -> None:
        """Append what ``batch`` says about this rank (durably at ``rank_end``)."""
        if self._file is None:
            return
        recs = self._convert(batch)
        if recs:
            try:
                self._file.write(recs, durable=any(r["type"] == "rank_end" for r in recs))
            except Exception:
                log.exception("rank %d: writing its rank file failed; switching it off", self.rank)
                self._file = None


class RankPoller:
    """Rank 0: every ``every_s``, the rank files' new records to each consumer."""

    def __init__(self, run_dir: str | os.PathLike[str], every_s: float) -> None:
        self.every_s = every_s
        self.consumers: list[Consumer] = []
        self._tail = RankTail(run_dir)
        self._due = 0.0

    def poll(self, force: bool = False) -> list[dict[str, Any]]:
        """Records the consumers want added to the ledger; nothing when not due yet
        (``force``: now anyway, e.g. at close)."""
        now = time.monotonic()
        if now < self._due and not force:
            return []
        self._due = now + self.every_s
        try:
            by_rank = self._tail.poll()
        except Exception:
            log.exception("reading the rank files failed; per-rank checks skipped this time")
            return []
        out: list[dict[str, Any]] = []
        if not by_rank:
            return out
        for consume in self.consumers:
            try:
                out.extend(consume(by_rank))
            except Exception:
                log.exception("per-rank consumer %r failed", consume)
        return out


class RankTail:
    """Reads every rank file's new complete lines since the last ``poll`` (rank 0's live
    straggler check and per-rank MLflow metrics). Files that exist when it is made are read
    from their current end (earlier attempts are the report's business), new files from
    their start. A partial last line waits for its end."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._pos: dict[int, int] = {}
        for rank, path in rank_files(run_dir):
            with contextlib.suppress(OSError):
                self._pos[rank] = path.stat().st_size
        self.torn = 0

    def poll(self, max_bytes: int = 1 << 22) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        for rank, path in rank_files(self.run_dir):
            pos = self._pos.get(rank, 0)
            try:  # a FIFO, device or symlink in a rank file's place is not read (no hang)
                with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
                    f.seek(pos)
                    data = f.read(max_bytes)
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._pos[rank] = pos + end + 1
            recs = []
            for line in data[: end + 1].splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    self.torn += 1
                    continue
                if isinstance(rec, dict):
                    recs.append(rec)
            if recs:
                out[rank] = recs
        return out


def rank_windows(by_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per rank over its new ``rank_step`` records: the window means and variances
    of ``fetch_seconds`` (time inside ``next()``: the data wait) and
    ``between_next_seconds`` (the caller's time between ``next()`` calls), the names
    Databricks' DataLoader logs per rank, so their dashboards read ours."""
    rows = []
    for rank, recs in sorted(by_rank.items()):
        steps = [r for r in recs if r.get("type") == "rank_step"]
        if not steps:
            continue
        row: dict[str, Any] = {"rank": rank, "step": max(int(r["step"]) for r in steps)}
        for key, name in (
            ("data_wait_s", "fetch_seconds"),
            ("between_next_s", "between_next_seconds"),
        ):
            vals = [float(r[key]) for r in steps if r.get(key) is not None]
            if vals:
                mean = sum(vals) / len(vals)
                row[name] = mean
                row[f"{name}_variance"] = sum((v - mean) ** 2 for v in vals) / len(vals)
        rows.append(row)
    return rows
