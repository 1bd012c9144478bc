"""The report's per-rank part: which rank, on which node, doing what.

``rank_section`` folds the run's rank files (``monitor/ranks.py``) into the report's
``ranks`` rows, ``missing_ranks`` and ``torn_lines`` (neither a missing file nor a torn line
is ever fatal), and runs the straggler analysis post hoc over the aligned step series, so a
report names a straggler even when the live check was off. ``plot_heatmaps`` draws rank x
step heatmaps of data wait and step time, with restarts and crashes marked on the step axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.stragglers import alert_config
from steadytrain.monitor.goodput import Breakdown
from steadytrain.monitor.ranks import RanksView
from steadytrain.printable import html_text, printable

__all__ = [
    "INCIDENT_KEYS",
    "attach_ranks",
    "charge_straggler_wait",
    "compute_waits",
    "crashes",
    "per_unit",
    "node_rows",
    "plot_heatmaps",
    "rank_section",
    "ranks_html",
    "straggler_waits",
    "where",
    "who",
]


# What each incident carries: "rank"/"node" name where it happened (rank 0 for alerts of
# rank 0's own ledger); "ranks" lists a node's ranks; "source": "live" (in the ledger) or
# "report" (found by the post-hoc straggler analysis, up to "last_step").
INCIDENT_KEYS = (
    "t",
    "step",
    "kind",
    "diagnosis",
    "message",
    "next",
    "rank",
    "ranks",
    "node",
    "cause",
    "evidence",
    "source",
    "last_step",
)


def crashes(
    starts: list[dict[str, Any]], ends: dict[int, dict[str, Any]], s: Any
) -> list[dict[str, Any]]:
    """Attempts that ended without a clean ``job_end`` (killed: none at all; or an error),
    each at its last recorded step and time. The newest attempt without ``job_end`` may
    still be running: not a crash."""
    last: dict[int, tuple[float, int]] = {}
    for a, t, st in zip(s.attempt, s.t, s.step, strict=True):
        last[a] = (t, st)
    out = []
    for i, start in enumerate(starts):
        end = ends.get(i)
        reason = str((end or {}).get("reason") or "")
        if end is None and i == len(starts) - 1:
            continue
        if end is not None and reason in ("finished", "interpreter_exit"):
            continue
        t, step = last.get(i, (start.get("t"), int(start.get("restored_step") or 0)))
        if end is not None:
            t, step = end.get("t", t), int(end.get("step") or step)
        out.append({"attempt": i, "t": t, "step": step, "reason": reason or "killed"})
    return out


def who(a: dict[str, Any]) -> str:
    """Where an incident happened: "rank 3 (node-b)", "ranks 2, 3 (node-b)", "every rank"."""
    ranks = a.get("ranks") or ([a["rank"]] if a.get("rank") is not None else [])
    if a.get("kind") == "shared_slowdown":
        return "every rank"
    if not ranks:
        return ""
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return who + (f" ({a['node']})" if a.get("node") else "")


def where(inc: dict[str, Any]) -> str:
    """Where an engine incident happened: "node-1, node-2 (ranks 1, 2)", "rank 3", ""."""
    nodes, ranks = inc.get("nodes") or [], inc.get("ranks") or []
    r = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    if nodes:
        return ", ".join(nodes) + (f" ({r})" if r else "")
    return r


def per_unit(device: str | None) -> str:
    """ "GPU" only on a CUDA run: a CPU (or unknown) run's unit is the rank."""
    return "GPU" if device == "cuda" else "rank"


_alert_config = alert_config  # the thresholds the newest attempt ran with


def rank_section(view: RanksView) -> dict[str, Any]:
    """``{ranks, missing_ranks, torn_lines, stragglers, view}`` from the run's rank files, as
    ``diagnose.inputs.load`` read them (invalid rank records skipped and counted there)."""
    # post-hoc stragglers are the diagnosis engine's now (diagnose/stragglers.py: the
    # report's ``incidents``); ``stragglers`` stays for callers of attach_ranks
    stragglers: list[dict[str, Any]] = []
    return {
        "ranks": view.rows(),
        "missing_ranks": view.missing,
        "torn_lines": view.torn_lines,
        "stragglers": stragglers,
        "view": view,
    }


def attach_ranks(
    alerts: list[dict[str, Any]],
    stragglers: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    step_t: dict[int, float],
) -> list[dict[str, Any]]:
    """Every incident with ``rank``, ``node`` and ``evidence``: rank-0-only alerts are rank
    0's (on its node); post-hoc stragglers the live check already raised are not repeated."""
    node0 = next((r["node"] for r in rows if r["rank"] == 0), None)
    out = []
    live = set()
    for a in alerts:
        a = dict(a)
        if "rank" not in a and "ranks" not in a:
            a["rank"], a["node"] = 0, node0
        a.setdefault("node", None)
        a.setdefault("evidence", {})
        a.setdefault("source", "live")
        live.add((a.get("kind"), tuple(a.get("ranks") or [a.get("rank")]), a.get("diagnosis")))
        out.append(a)
    for s in stragglers:
        if (s["kind"], tuple(s["ranks"]), s["diagnosis"]) in live:
            continue
        out.append({**s, "t": step_t.get(s["step"])})
    return sorted(out, key=lambda a: (a.get("t") is None, a.get("t") or 0.0, a.get("step") or 0))


def _label(row: dict[str, Any]) -> str:
    """ "rank 1 (node-1, node-2)": every node the rank ran on, oldest first (a node name's
    control characters shown as escapes: it is a plot's label)."""
    nodes = row.get("nodes") or ([row["node"]] if row.get("node") else [])
    text = f"rank {row['rank']} ({', '.join(nodes)})" if nodes else f"rank {row['rank']}"
    return printable(text)


def node_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks table's lines: one per (rank, node). A rank that a restart placed on
    another node has one line per node (its ``per_node`` entries), each with that node's
    steps and data wait; read p99 and cache figures of such a line are the rank's own
    (``None`` where only the whole rank's is known)."""
    out = []
    for r in rows:
        for p in r.get("per_node") or [r]:
            out.append({**r, **p, "read_p99_s": r["read_p99_s"] if p is r else None})
    return out


def plot_heatmaps(
    section: dict[str, Any],
    marks: dict[str, list[int]],
    device: str | None,
    out: Path,
    plt: Any,
    drawn: dict[str, Any] | None = None,
) -> str | None:
    """``ranks.png``: data wait and step time per step, one row per rank, x = step bins
    (``RanksView.aligned()``); dashed lines: restarts (from the restored step), red: crashes."""
    import numpy as np

    view = section["view"]
    width, grid = view.aligned()
    ranks = sorted(grid)
    last = max((b for g in grid.values() for b in g), default=-1)
    if not ranks or last < 0:
        return None
    unit = per_unit(device)
    labels = [_label(view.ranks[r].row()) for r in ranks]
    if drawn is not None:
        drawn["ranks"] = {"rows": labels}
    height = min(12.0, 1.5 + 0.25 * len(ranks))
    fig, axes = plt.subplots(2, 1, figsize=(11, 2 * height), sharex=True)
    extent = (0.5, (last + 1) * width + 0.5, len(ranks) - 0.5, -0.5)
    for ax, key, title in zip(
        axes, ("data_wait_s", "step_s"), ("data wait", "step time"), strict=True
    ):
        m = np.full((len(ranks), last + 1), np.nan)
        for i, r in enumerate(ranks):
            for b, v in grid[r].items():
                if v.get("n") and key in v:
                    m[i, b] = v[key] / v["n"]
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma_r", extent=extent)
        fig.colorbar(im, ax=ax, label=f"{title}, s per step (per {unit})")
        step = max(1, len(ranks) // 40)  # at most ~40 row labels
        ax.set_yticks(range(0, len(ranks), step))
        ax.set_yticklabels(labels[::step], fontsize=7)
        ax.set_title(
            f"{title.capitalize()} per {unit} and step"
            + (f" (bins of {width} steps)" if width > 1 else "")
        )
        for i, s in enumerate(marks.get("restarts", [])):
            ax.axvline(
                s + 0.5, color="#1565c0", ls="--", lw=1.2, label="restart" if i == 0 else None
            )
        for i, s in enumerate(marks.get("crashes", [])):
            ax.axvline(s + 0.5, color="#c62828", lw=1.5, label="crash" if i == 0 else None)
        if marks.get("restarts") or marks.get("crashes"):
            ax.legend(loc="upper left", bbox_to_anchor=(1.15, 1.0), fontsize=8)
    axes[-1].set_xlabel("step")
    path = out / "ranks.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def ranks_html(summary: dict[str, Any], img: Any) -> str:
    """The page's "Ranks" section (empty when the run wrote no rank files)."""
    e = html_text  # node names come from the rank files
    rows = summary.get("ranks") or []
    if not rows and not summary.get("missing_ranks"):
        return ""
    unit = per_unit(summary.get("device"))

    def num(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    body = "".join(
        f"<tr><td>{r['rank']}</td><td>{e(str(r.get('node')))}</td><td>{r['steps']}</td>"
        f"<td>{num(r['data_wait_s'], '.2f')}</td><td>{num(r['data_wait_share'], '.1%')}</td>"
        f"<td>{num(r['read_p99_s'] and r['read_p99_s'] * 1e3, '.1f')}</td>"
        f"<td>{r['cache_misses']}</td><td>{num(r['rss_mib'], '.0f')}</td>"
        f"<td>{num(r['shm_mib'], '.0f')}</td><td>{num(r['checkpoint_block_s'], '.2f')}</td></tr>"
        for r in node_rows(rows)
    )
    parts = [f"<h2>Ranks (one row per {unit} and node it ran on)</h2>"]
    if summary.get("missing_ranks"):
        miss = ", ".join(
            f"rank {m['rank']} of attempt {m['attempt']} ({m['reason']})"
            for m in summary["missing_ranks"]
        )
        parts.append(f"<p><b>Missing:</b> {e(miss)}.</p>")
    if summary.get("torn_lines"):
        parts.append(
            f"<p>{summary['torn_lines']} torn line(s) skipped (a rank killed mid-write).</p>"
        )
    parts.append(
        "<table><tr><th>rank</th><th>node</th><th>steps</th><th>data wait (s)</th>"
        "<th>share</th><th>read p99 (ms)</th><th>cache misses</th><th>RSS (MiB)</th>"
        f"<th>/dev/shm (MiB)</th><th>checkpoint block (s)</th></tr>{body}</table>"
    )
    if figure := img("ranks"):  # the heatmaps, or why they are missing
        parts.append(figure)
    return "\n".join(parts)


def compute_waits(
    incidents: Iterable[Incident | dict[str, Any]],
) -> list[tuple[int, int, float, int]]:
    """What the diagnosis engine found the other ranks waited for a slow forward pass:
    ``(first step, last step, seconds per step, rank)`` of each window of every ``compute``
    and ``host-contention`` incident (its ``wait_s_per_step``, diagnose/stragglers.py;
    an entry without a rank counts as a rank of its own, -1)."""
    out = []
    for inc in incidents:
        kind = inc.kind if isinstance(inc, Incident) else inc.get("kind")
        ev = inc.evidence if isinstance(inc, Incident) else inc.get("evidence")
        if kind not in ("compute", "host-contention") or not isinstance(ev, dict):
            continue
        for w in ev.get("wait_s_per_step") or []:
            if not isinstance(w, (list, tuple)) or len(w) not in (3, 4):
                continue
            if all(isinstance(x, (int, float)) and math.isfinite(x) for x in w):
                rank = int(w[3]) if len(w) == 4 else -1
                out.append((int(w[0]), int(w[1]), max(0.0, float(w[2])), rank))
    return out


def straggler_waits(
    view: RanksView, waits: Iterable[tuple[int, int, float, int]] = ()
) -> tuple[float, float]:
    """``(data, compute)``: time rank 0 booked as compute while the job waited for a
    slower rank (synchronous data parallelism: a step goes at the pace of its slowest
    rank). Per step bin, each rank held the others up by its data wait beyond rank 0's (a
    rank slow in ``next()``) plus the wait per step the engine found for its slow compute
    (``waits``: ``compute_waits`` of the incidents; its data wait and its compute come one
    after the other); the step waited for the rank that held it up most. ``data`` is rank
    0's steps times the worst data excess (a lower bound of the per-step sum: bins average
    within themselves), ``compute`` what the worst rank's hold-up adds beyond that; rank 0
    itself counts, its slowed compute being booked as work. (0, 0) without rank files or
    rank 0's."""
    waits = list(waits)
    width, bins = view.aligned()
    own = bins.get(0)
    if not own or len(bins) < 2:
        return 0.0, 0.0
    data = compute = 0.0
    for idx, b0 in own.items():
        n0 = b0.get("n") or 0
        if not n0:
            continue
        mine = b0.get("data_wait_s", 0.0) / n0
        first, last = idx * width + 1, (idx + 1) * width
        held: dict[int, float] = {}  # rank -> its hold-up per step in this bin
        data_worst = 0.0
        for r, b in bins.items():
            if idx in b and b[idx].get("n"):
                excess = max(0.0, b[idx].get("data_wait_s", 0.0) / b[idx]["n"] - mine)
                held[r] = excess
                data_worst = max(data_worst, excess)
        for a, z, s, r in waits:
            if a <= last and first <= z:
                held[r] = held.get(r, 0.0) + s
        data += n0 * data_worst
        compute += n0 * max(0.0, max(held.values(), default=0.0) - data_worst)
    return data, compute


def charge_straggler_wait(
    b: Breakdown, view: RanksView, incidents: Iterable[Incident | dict[str, Any]] = ()
) -> Breakdown:
    """``b`` with ``straggler_waits`` moved from goodput into badput buckets of their own:
    ``straggler_wait`` (a rank slow in ``next()``) and ``straggler_compute`` (a rank slow
    in its own compute, as the engine's incidents measured it). Rank 0's ledger alone sees
    neither. Each is capped at the productive time left (``b.capped`` says when and by how
    much). The report calls this once; every view prints the breakdown it returns."""
    data, compute = straggler_waits(view, compute_waits(incidents))
    return b.charged("straggler_wait", data).charged("straggler_compute", compute)
