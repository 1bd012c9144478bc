"""Data slowdowns no healthy rank shows: every rank (or the only one) against its own start.

``stragglers`` compares ranks with each other; when every rank waits for data alike (the
object store every node reads slowed down, or a one-rank run's loader falls behind) there
is no healthy rank to compare with. Here the healthy level of the data wait (``healthy_ref``
over the ranks, the rank itself in a one-rank run) is compared with **its own early
history**: the median of the first ``BASE_WINDOWS`` windows after ``warmup``. A window is
slow when the level is twice that baseline and above it by the straggler floors
(``straggler_min_s``, ``straggler_share`` of the baseline step time, ``NOISE_K`` x the
level's own jitter); an episode needs ``MIN_WINDOWS`` slow windows and ``MIN_LOST_SHARE`` of
the job's step time, as a straggler's does. The cause is judged on the rank that waited
most, against its own baseline windows (``data_cause``); the incident names every node and
rank. A run slow from its first steps has no baseline here: nothing is said.
"""

from __future__ import annotations

import statistics
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.diagnose.straggler_parts import attempt_of, fold_windows, jitter, runs_of, t_of
from steadytrain.diagnose.stragglers import (
    MIN_LOST_SHARE,
    MIN_WINDOWS,
    NOISE_K,
    alert_config,
    windows_of,
)
from steadytrain.monitor.windows import Window, data_cause, healthy_ref

__all__ = ["detect", "BASE_WINDOWS"]

BASE_WINDOWS = 3  # windows after warm-up that define each run's normal data wait
RATIO = 2.0  # the level must be this many times its baseline, too


def _level(row: dict[int, Window]) -> float | None:
    return healthy_ref(w.per(w.data_wait_s) for w in row.values())


def detect(rec: RunRecords) -> list[Incident]:
    cfg = alert_config(rec.starts)
    _, _, _, wins = windows_of(rec.view, cfg)
    if len(wins) < BASE_WINDOWS + MIN_WINDOWS:
        return []
    levels = [_level(row) for row in wins]
    base_levels = [v for v in levels[:BASE_WINDOWS] if v is not None]
    if not base_levels:
        return []
    base = statistics.median(base_levels)
    base_step = statistics.median(
        [w.per(w.step_s) or 0.0 for row in wins[:BASE_WINDOWS] for w in row.values()]
    )
    noise = jitter(levels[:BASE_WINDOWS] + levels)  # the start's jitter weighs double
    floor = max(cfg.straggler_min_s, cfg.straggler_share * base_step, NOISE_K * noise)
    flags = [False] * BASE_WINDOWS
    flags += [v is not None and v - base >= floor and v >= RATIO * base
              for v in levels[BASE_WINDOWS:]]  # fmt: skip
    total_step_s = sum(statistics.median([w.step_s for w in row.values()]) for row in wins)
    out = []
    for idx in runs_of(flags):
        if sum(flags[i] for i in idx) < MIN_WINDOWS:
            continue
        span = range(idx[0], idx[-1] + 1)
        lost = sum(max(0.0, (levels[i] or 0.0) - base) * _steps(wins[i]) for i in span)
        if lost < MIN_LOST_SHARE * total_step_s:
            continue
        out.append(_incident(rec, wins, list(span), base, lost, cfg))
    return out


def _steps(row: dict[int, Window]) -> int:
    return max((w.n for w in row.values()), default=0)


def _incident(rec: RunRecords, wins: list[dict[int, Window]], span: list[int], base: float,
              lost: float, cfg: Any) -> Incident:  # fmt: skip
    ranks = sorted({r for i in span for r in wins[i]})
    mine = {r: fold_windows([wins[i][r] for i in span if r in wins[i]]) for r in ranks}
    worst = max(ranks, key=lambda r: mine[r].per(mine[r].data_wait_s) or 0.0)
    before = fold_windows([wins[i][worst] for i in range(BASE_WINDOWS) if worst in wins[i]])
    me = mine[worst]
    grown = fold_windows([wins[i][worst] for i in range(span[-1] + 1) if worst in wins[i]])
    me.mem_first, me.mem_last = grown.mem_first, grown.mem_last  # memory since the start
    kind, ev = data_cause(me, [before], before, cfg)
    first = min(w.first_step for i in span for w in wins[i].values() if w.first_step)
    last = max(w.last_step for i in span for w in wins[i].values() if w.last_step)
    ev.update(
        data_wait_s_per_step=me.per(me.data_wait_s),
        baseline_data_wait_s_per_step=base,
        every_rank=True,
        worst_rank=worst,
    )
    nodes = sorted({n for r in ranks for n in rec.nodes_of([r], first)})
    inc = Incident(kind=kind, nodes=nodes, ranks=ranks, first_step=first, last_step=last,
                   lost_s=lost, evidence=ev, t=t_of(rec, first),
                   attempt=attempt_of(rec, first))  # fmt: skip
    who = "every rank" if len(ranks) > 1 else f"rank {ranks[0]}"
    where = f" on {', '.join(nodes)}" if nodes else ""
    inc.message = (
        f"{who}{where} waited {ev['data_wait_s_per_step']:.3f} s/step for data over steps "
        f"{first}-{last} against {base:.3f} s at the run's start, none healthier than the "
        f"others (a cause they share)" + _detail(kind, ev) + f"; cost {lost:.1f} s of job time"
    )
    return inc


def _detail(kind: str, ev: dict[str, Any]) -> str:
    if kind == "storage" and ev.get("read_p99_s") is not None:
        b = ev.get("baseline_read_p99_s")
        return f"; read p99 {ev['read_p99_s'] * 1e3:.0f} ms" + (
            f" vs {b * 1e3:.0f} ms at the start" if b is not None else ""
        )
    if kind == "loader-memory" and ev.get("memory_growth_bytes") is not None:
        return f"; loader memory grew {ev['memory_growth_bytes'] / (1 << 20):.0f} MiB"
    return ""
