"""The live straggler check: rank 0's background thread reads every rank's new records.

Every ``straggler_every_s`` (``MeterConfig``; 0 turns it off) the meter's background thread
on rank 0 polls every rank file's new records (``RankTail``: no collective, nothing on the
training loop's path) and hands them to ``StragglerCheck.consume``: the newest steps all
ranks of the current attempt have written are aligned by step index and
``straggler.classify`` judges them. It sees only the rank files that reach rank 0's run
directory: a multi-node job keeps RUN_DIR on shared storage, else the report (after the
files are gathered) is where the other nodes' stragglers show.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableSequence
from pathlib import Path
from typing import Any

from steadytrain.monitor.alerts import AlertConfig, warn_alert
from steadytrain.monitor.rank_recorder import RankTail
from steadytrain.monitor.ranks import read_ranks
from steadytrain.monitor.straggler import (
    Window,
    classify,
    device_of_ranks,
    finding_key,
    fold,
    to_alert,
)

__all__ = ["StragglerCheck"]

log = logging.getLogger("steadytrain.monitor")


class StragglerCheck:
    """Rank 0's live check: ``consume`` takes every rank's new records (the meter's
    ``RankTail`` poll, one of its ``rank_consumers``), aligns the newest steps all ranks of
    the current attempt have written and ``classify``-es them. One alert per incident; it
    re-arms when the condition clears. ``raised``: a list (the meter's ``alerts``) that
    every new alert is appended to. The baseline is the first ``baseline`` steps after
    ``warmup`` that the check saw of the attempt."""

    def __init__(
        self,
        run_dir: str | Path,
        cfg: AlertConfig | None = None,
        raised: MutableSequence[dict[str, Any]] | None = None,
    ) -> None:
        self.run_dir, self.cfg, self.raised = Path(run_dir), cfg or AlertConfig(), raised
        self._tail: RankTail | None = None  # only ``check`` (standalone use) polls itself
        self.steps: dict[int, dict[int, dict[str, Any]]] = {}  # rank -> step -> record
        self.base: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        self.base_folded: dict[int, Window] = {}
        self.seen: dict[int, int] = {}  # steps seen per rank in its current attempt
        self.attempt: dict[int, int] = {}
        self.nodes: dict[int, str | None] = {}
        self.device: str | None = None
        self.active: set[tuple[Any, ...]] = set()

    def _learn(self, rank: int, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind not in ("rank_start", "rank_step"):
            return  # rank_end, hang: nothing to align
        attempt = int(rec.get("attempt") or 0)
        if kind == "rank_start" or attempt != self.attempt.get(rank, attempt):
            self.steps[rank], self.base[rank], self.seen[rank] = {}, [], 0
            self.base_folded.pop(rank, None)
        self.attempt[rank] = attempt
        if kind == "rank_start":
            self.nodes[rank] = rec.get("node")
            self.device = rec.get("device") or self.device
            return
        step, c = int(rec["step"]), self.cfg
        steps = self.steps.setdefault(rank, {})
        steps[step] = rec
        self.seen[rank] = self.seen.get(rank, 0) + 1
        if c.warmup < self.seen[rank] <= c.warmup + c.baseline:
            self.base.setdefault(rank, []).append((step, rec))

    def check(self) -> list[dict[str, Any]]:
        """Poll the rank files itself, then ``consume`` (standalone use and tests)."""
        if self._tail is None:
            self._tail = RankTail(self.run_dir)
        return self.consume(self._tail.poll())

    def consume(self, by_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """New alert records (``type: alert``) from every rank's new records."""
        keep = 2 * self.cfg.straggler_window
        for rank, recs in by_rank.items():
            for rec in recs:
                self._learn(rank, rec)
            steps = self.steps.get(rank)
            if steps and len(steps) > keep:  # memory: the newest steps only
                for s in sorted(steps)[: len(steps) - keep]:
                    del steps[s]
        if any(r not in self.nodes for r in self.steps):  # started before our first poll
            view = read_ranks(self.run_dir)
            for r, s in view.ranks.items():
                self.nodes.setdefault(r, s.node)
            self.device = self.device or device_of_ranks(view)
        current = max(self.attempt.values(), default=0)
        ranks = [r for r, a in self.attempt.items() if a == current and self.steps.get(r)]
        if len(ranks) < 2:
            return []
        common = set.intersection(*(set(self.steps[r]) for r in ranks))
        window = sorted(common)[-self.cfg.straggler_window :]
        if len(window) < max(3, self.cfg.straggler_window // 2):
            return []
        recent = {r: fold((s, self.steps[r][s]) for s in window) for r in ranks}
        base = None
        if all(len(self.base.get(r, [])) >= self.cfg.baseline for r in ranks):
            for r in ranks:  # folded once: the baseline is complete
                if r not in self.base_folded:
                    self.base_folded[r] = fold(self.base[r])
            base = {r: self.base_folded[r] for r in ranks}
        out, seen = [], set()
        for f in classify(recent, base, self.nodes, self.cfg, self.device):
            k = finding_key(f)
            seen.add(k)
            if k not in self.active:
                out.append(to_alert(f, window[-1], time.time(), self.device))
                warn_alert(f, log)
        self.active = seen
        if self.raised is not None:
            self.raised.extend(out)
        return out
