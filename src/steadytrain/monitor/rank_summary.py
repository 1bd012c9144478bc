"""One rank's history folded into a summary whose size does not grow with the run.

``RankSummary.add(record)`` folds ``rank_start`` / ``rank_step`` / ``rank_end`` records
(monitor/ranks.py) into totals, memory extremes, a read-time histogram and a ``StepSeries``
of at most ``MAX_BINS`` step bins. Its ``state_dict`` is what a rank file's snapshot holds,
so a reader starts from it instead of the file's first byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from steadytrain.monitor.records import finite_tree

__all__ = ["MAX_BINS", "RANK_KEYS", "StepSeries", "RankSummary", "wait_share"]

# What a rank_step record keeps of the meter's step record (and of the loader's metrics).
RANK_KEYS = (
    "step_s",
    "data_wait_s",
    "between_next_s",
    "compute_s",
    "forward_s",
    "checkpoint_block_s",
    "eval_s",
    "read_p99_s",
    "read_s",
    "bytes_read",
    "cache_hits",
    "cache_misses",
    "rss_bytes",
    "shm_bytes",
)
MAX_BINS = 256  # step bins kept per rank (the heatmap's resolution)
EARLY_STEPS = 10  # an attempt's first steps, whose reads are kept apart (a spare's start)
# 2: per-node tallies (``by_node``); a version-1 snapshot is not loaded (the reader then
# folds the whole rank file again, which rebuilds them). 3: per-attempt facts in each
# ``attempts`` entry (last step and time, rank_end, early reads).
SUMMARY_VERSION = 3
# Nodes a rank's tallies are kept apart for (a rank moves only at a restart); beyond these
# a rank's steps are added to its newest kept node's tally.
MAX_NODES = 64
_TALLY_INTS = ("attempts", "steps", "first_step", "last_step")  # not floats in a tally
# Summed over steps: every timing and counter of a rank_step record (RANK_KEYS, in
# monitor/ranks.py) but the gauges, whose extremes are kept instead.
_GAUGES = ("read_p99_s", "rss_bytes", "shm_bytes")
_SUMS = tuple(k for k in RANK_KEYS if k not in _GAUGES)
# Read-time histogram: 10 log bins a decade from 1 us to 1000 s (percentiles within ~12 %).
_H_LO, _H_PER_DECADE, _H_BINS = -6.0, 10, 90


def wait_share(wait: float, step_s: float, eval_s: float) -> float:
    """A rank's data wait as a share of its step time outside evaluation: a validation
    between two steps is in ``step_s`` but no part of the time the loop trained or waited
    for data (issue 42: Lightning's ranks table said 39-47 % "data wait" of its validation)."""
    busy = step_s - eval_s
    return wait / busy if busy > 0 else 0.0


def _num(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class StepSeries:
    """Per step bin, aligned by step index: sums of the timing fields, maxima of memory.
    At most ``max_bins`` bins; when a step falls beyond them, neighbours merge in pairs
    and the bin width doubles (memory flat in the run's length, resolution halves)."""

    FIELDS = ("step_s", "data_wait_s", "forward_s", "compute_s", "cache_misses", "read_s")
    # host signals of rank_recorder.HostSampler, summed per bin like the timings (mean =
    # sum / n): the diagnosis tells host contention from a slow rank with them
    HOST = ("host_run_queue", "host_cpus", "host_steal", "host_throttled")
    MAXES = ("rss_bytes", "shm_bytes", "read_p99_s")

    def __init__(self, max_bins: int = MAX_BINS) -> None:
        self.max_bins = max_bins
        self.width = 1
        self.bins: dict[int, dict[str, float]] = {}

    def add(self, step: int, rec: dict[str, Any]) -> None:
        idx = max(0, step - 1) // self.width
        while idx >= self.max_bins:
            self._halve()
            idx = max(0, step - 1) // self.width
        b = self.bins.setdefault(idx, {"n": 0})
        b["n"] += 1
        for k in self.FIELDS + self.HOST:
            v = rec.get(k)
            if v is not None:
                b[k] = b.get(k, 0.0) + float(v)
        for k in self.MAXES:
            v = rec.get(k)
            if v is not None:
                b[k] = max(b.get(k, 0.0), float(v))

    def _halve(self) -> None:
        self.bins, self.width = self._merged(2), self.width * 2

    def rebin(self, width: int) -> dict[int, dict[str, float]]:
        """The bins at a coarser ``width`` (a multiple of this one): ranks that wrote
        different numbers of steps are compared on one grid."""
        return self.bins if width == self.width else self._merged(width // self.width)

    def _merged(self, factor: int) -> dict[int, dict[str, float]]:
        """Every ``factor`` neighbouring bins as one: sums add up, maxima stay maxima."""
        out: dict[int, dict[str, float]] = {}
        for idx, b in self.bins.items():
            m = out.setdefault(idx // factor, {"n": 0})
            m["n"] += b["n"]
            for k in self.FIELDS + self.HOST:
                if k in b:
                    m[k] = m.get(k, 0.0) + b[k]
            for k in self.MAXES:
                if k in b:
                    m[k] = max(m.get(k, 0.0), b[k])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"width": self.width, "max_bins": self.max_bins, "bins": self.bins}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        width, max_bins = int(sd["width"]), int(sd["max_bins"])
        # A snapshot is read back from disk: a width that is not a power of two (re-binning
        # assumes one) or more bins than promised is a corrupt one (the caller then reads
        # the whole rank file instead).
        if width < 1 or width & (width - 1) or not 1 <= max_bins <= 1 << 16:
            raise ValueError(f"step series width {width} / max_bins {max_bins}")
        bins = {int(k): dict(v) for k, v in sd["bins"].items()}
        if len(bins) > max_bins or any(k < 0 or k >= max_bins for k in bins):
            raise ValueError("step series bins out of range")
        self.width, self.max_bins, self.bins = width, max_bins, bins


@dataclass
class RankSummary:
    """One rank's whole history, folded record by record (``add``)."""

    rank: int
    node: str | None = None
    nodes: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    sums: dict[str, float] = field(default_factory=dict)
    rss_max: float = 0.0
    rss_first: float | None = None
    rss_last: float | None = None
    shm_max: float = 0.0
    shm_first: float | None = None
    shm_last: float | None = None
    read_hist: list[int] = field(default_factory=lambda: [0] * _H_BINS)
    ended: dict[str, Any] | None = None  # the newest rank_end record
    series: StepSeries = field(default_factory=StepSeries)
    # Per node this rank ran on (a restart may place it elsewhere): {node: {"steps",
    # "attempts", sums of the timing fields, "rss_max", "shm_max"}}, so the report shows
    # rank 1 on node-1 and on node-2 as two rows, not one row under the newest node.
    by_node: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "rank_step":
            self._add_step(rec)
        elif kind == "rank_start":
            node = rec.get("node")
            self.node = node
            if node is not None and node not in self.nodes:
                self.nodes.append(node)
            keep = ("attempt", "node", "world_size", "local_rank", "pid", "t", "device", "addrs")
            keep += ("born_t",)  # the process's birth (report/restarts.py)
            self.attempts.append({k: rec.get(k) for k in keep})
            tally = self._tally()
            if tally is not None and rec.get("attempt") not in tally["attempts"]:
                tally["attempts"].append(rec.get("attempt"))
            self.ended = None
        elif kind == "rank_end":
            self.ended = {k: rec.get(k) for k in ("attempt", "step", "reason", "t")}
            cur = self._current(rec)
            if cur is not None:
                cur["end"] = dict(self.ended)

    def _current(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The ``attempts`` entry ``rec`` belongs to (the newest, when the attempt numbers
        agree or ``rec`` names none), else None."""
        if not self.attempts:
            return None
        cur = self.attempts[-1]
        a = rec.get("attempt")
        return cur if a is None or cur.get("attempt") is None or a == cur["attempt"] else None

    def _add_attempt_step(self, rec: dict[str, Any], step: int) -> None:
        """Per-attempt facts the failure diagnosis reads (diagnose/failures.py): the steps
        it ran, when it last made progress, and what its first ``EARLY_STEPS`` steps read
        (a spare that read remotely at its start). Kept in the ``attempts`` entry, so a
        snapshot carries them; flat in the run's length."""
        cur = self._current(rec)
        if cur is None:
            return
        # a snapshot's entry is read back from disk: a non-number counts as absent
        cur["steps"] = int(_num(cur.get("steps")) or 0) + 1
        first, last = _num(cur.get("first_step")), _num(cur.get("last_step"))
        cur["first_step"] = step if first is None else min(int(first), step)
        cur["last_step"] = step if last is None else max(int(last), step)
        if rec.get("t") is not None:
            cur["last_t"] = float(rec["t"])
        early = cur["steps"] <= EARLY_STEPS
        for k in ("bytes_read", "cache_misses", "cache_hits"):
            v = rec.get(k)
            if v is None:
                continue
            cur[k] = (_num(cur.get(k)) or 0.0) + float(v)
            if early:
                cur[f"early_{k}"] = (_num(cur.get(f"early_{k}")) or 0.0) + float(v)
        if early:
            cur["early_steps"] = cur["steps"]

    def _add_step(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        self._add_attempt_step(rec, step)
        self.steps += 1
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        for k in _SUMS:
            v = rec.get(k)
            if v is not None:
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
        rss, shm = rec.get("rss_bytes"), rec.get("shm_bytes")
        if rss is not None:
            self.rss_max = max(self.rss_max, float(rss))
            self.rss_first = float(rss) if self.rss_first is None else self.rss_first
            self.rss_last = float(rss)
        if shm is not None:
            self.shm_max = max(self.shm_max, float(shm))
            self.shm_first = float(shm) if self.shm_first is None else self.shm_first
            self.shm_last = float(shm)
        p99 = rec.get("read_p99_s")
        if p99 is not None and p99 > 0:
            i = int((math.log10(p99) - _H_LO) * _H_PER_DECADE)
            self.read_hist[min(_H_BINS - 1, max(0, i))] += 1
        self.series.add(step, rec)
        tally = self._tally()
        if tally is not None:
            tally["steps"] += 1
            tally["first_step"] = min(tally.get("first_step", step), step)
            tally["last_step"] = max(tally.get("last_step", step), step)
            for k in _SUMS:
                v = rec.get(k)
                if v is not None:
                    tally[k] = tally.get(k, 0.0) + float(v)
            for k, v in (("rss_max", rss), ("shm_max", shm)):
                if v is not None:
                    tally[k] = max(tally.get(k, 0.0), float(v))

    def _tally(self) -> dict[str, Any] | None:
        """The current node's tally (None before any ``rank_start`` named a node)."""
        node = self.node
        if node is None:
            return None
        if node not in self.by_node and len(self.by_node) >= MAX_NODES:
            node = next(reversed(self.by_node))
        return self.by_node.setdefault(node, {"steps": 0, "attempts": []})

    def node_at(self, step: int) -> str | None:
        """The node this rank ran ``step`` on: the newest node whose steps span it (a
        redone step counts where it was redone), else the newest node (``self.node``)."""
        for node, t in reversed(self.by_node.items()):
            if t.get("first_step", step + 1) <= step <= t.get("last_step", -1):
                return node
        return self.node

    def node_rows(self) -> list[dict[str, Any]]:
        """One row per node this rank ran on, in the order it ran there: ``{"rank",
        "node", "attempts", "steps", "step_s", "data_wait_s", "data_wait_share", "eval_s",
        "cache_misses", "checkpoint_block_s", "rss_mib", "shm_mib"}`` (``data_wait_share``:
        of the step time outside evaluation, ``wait_share``). A rank that never
        named its node: one row with ``node`` None and the rank's totals."""
        mib = 1 / (1 << 20)
        if not self.by_node:
            r = self.row()
            keep = ("step_s", "data_wait_s", "data_wait_share", "eval_s", "cache_misses")
            return [
                {
                    "rank": self.rank,
                    "node": self.node,
                    "attempts": [a.get("attempt") for a in self.attempts],
                    "steps": self.steps,
                    **{k: r[k] for k in keep},
                    "checkpoint_block_s": r["checkpoint_block_s"],
                    "rss_mib": r["rss_mib"],
                    "shm_mib": r["shm_mib"],
                }
            ]
        out = []
        for node, t in self.by_node.items():
            step_s, wait = t.get("step_s", 0.0), t.get("data_wait_s", 0.0)
            out.append(
                {
                    "rank": self.rank,
                    "node": node,
                    "attempts": list(t["attempts"]),
                    "steps": int(t["steps"]),
                    "first_step": t.get("first_step"),
                    "last_step": t.get("last_step"),
                    "step_s": step_s,
                    "data_wait_s": wait,
                    "data_wait_share": wait_share(wait, step_s, t.get("eval_s", 0.0)),
                    "eval_s": t.get("eval_s", 0.0),
                    "cache_misses": int(t.get("cache_misses", 0)),
                    "checkpoint_block_s": t.get("checkpoint_block_s", 0.0),
                    "rss_mib": t["rss_max"] * mib if "rss_max" in t else None,
                    "shm_mib": t["shm_max"] * mib if "shm_max" in t else None,
                }
            )
        return out

    def read_p99_s(self) -> float | None:
        """The 99th percentile over steps of the loader's per-step read p99 (histogram
        upper bin edge: an over- rather than an under-estimate)."""
        n = sum(self.read_hist)
        if not n:
            return None
        need, seen = math.ceil(0.99 * n), 0
        for i, c in enumerate(self.read_hist):
            seen += c
            if seen >= need:
                return 10 ** (_H_LO + (i + 1) / _H_PER_DECADE)
        return None

    def row(self) -> dict[str, Any]:
        """The report's ``ranks`` entry for this rank."""
        s = self.sums
        step_s = s.get("step_s", 0.0)
        wait = s.get("data_wait_s", 0.0)
        mib = 1 / (1 << 20)
        return {
            "rank": self.rank,
            "node": self.node,
            "nodes": list(self.nodes),
            "steps": self.steps,
            "last_step": self.last_step,
            "step_s": step_s,
            "data_wait_s": wait,
            "data_wait_share": wait_share(wait, step_s, s.get("eval_s", 0.0)),
            "eval_s": s.get("eval_s", 0.0),
            "between_next_s": s.get("between_next_s", 0.0),
            "forward_s": s.get("forward_s"),
            "read_p99_s": self.read_p99_s(),
            "bytes_read": int(s.get("bytes_read", 0)),
            "cache_hits": int(s.get("cache_hits", 0)),
            "cache_misses": int(s.get("cache_misses", 0)),
            "rss_mib": self.rss_max * mib if self.rss_last is not None else None,
            "rss_growth_mib": (self.rss_last - self.rss_first) * mib
            if self.rss_last is not None and self.rss_first is not None
            else None,
            "shm_mib": self.shm_max * mib if self.shm_last is not None else None,
            "shm_growth_mib": (self.shm_last - self.shm_first) * mib
            if self.shm_last is not None and self.shm_first is not None
            else None,
            "checkpoint_block_s": s.get("checkpoint_block_s", 0.0),
            "attempts": len(self.attempts),
            # one entry per node it ran on (``node_rows``): "node" above is the newest
            "per_node": self.node_rows() if len(self.by_node) > 1 else [],
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SUMMARY_VERSION,
            "rank": self.rank,
            "node": self.node,
            "nodes": self.nodes,
            "attempts": self.attempts,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "sums": self.sums,
            "rss": [self.rss_max, self.rss_first, self.rss_last],
            "shm": [self.shm_max, self.shm_first, self.shm_last],
            "read_hist": self.read_hist,
            "ended": self.ended,
            "series": self.series.state_dict(),
            "by_node": self.by_node,
        }

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> RankSummary:
        if sd.get("version") != SUMMARY_VERSION:
            raise ValueError(f"rank summary version {sd.get('version')!r}")
        # Every number of a summary is a count, a sum of durations or a size: finite, >= 0.
        if not finite_tree(sd, nonneg=True):
            raise ValueError("rank summary holds a negative or non-finite number")
        if len(sd["read_hist"]) != _H_BINS or len(sd["rss"]) != 3 or len(sd["shm"]) != 3:
            raise ValueError("rank summary histogram or memory fields malformed")
        if not (
            all(isinstance(a, dict) for a in sd["attempts"])
            and all(isinstance(n, str) for n in sd["nodes"])
            and isinstance(sd["sums"], dict)
            and (sd["ended"] is None or isinstance(sd["ended"], dict))
            and all(isinstance(x, int) for x in sd["read_hist"])
            and isinstance(sd["by_node"], dict)
            and len(sd["by_node"]) <= MAX_NODES
            and all(
                isinstance(t, dict) and isinstance(t.get("attempts"), list)
                for t in sd["by_node"].values()
            )
        ):
            raise ValueError("rank summary fields of the wrong type")
        out = cls(rank=int(sd["rank"]), node=sd["node"], nodes=list(sd["nodes"]))
        out.attempts, out.steps = list(sd["attempts"]), int(sd["steps"])
        out.first_step, out.last_step = sd["first_step"], sd["last_step"]
        out.sums = {k: float(v) for k, v in sd["sums"].items()}
        out.rss_max, out.rss_first, out.rss_last = sd["rss"]
        out.shm_max, out.shm_first, out.shm_last = sd["shm"]
        out.read_hist, out.ended = list(sd["read_hist"]), sd["ended"]
        out.series.load_state_dict(sd["series"])
        out.by_node = {
            str(n): {
                **{k: float(v) for k, v in t.items() if k not in _TALLY_INTS},
                **{k: int(t[k]) for k in _TALLY_INTS if k in t and k != "attempts"},
                "steps": int(t.get("steps", 0)),
                "attempts": list(t["attempts"]),
            }
            for n, t in sd["by_node"].items()
        }
        return out
