"""The report's per-node timeline: one row per node, its attempts, crashes and incidents.

The throughput plot says *when* something happened and the incident table *where*; an
operator of a many-node job wants both at a glance: which node was running which attempt,
where the job crashed and restarted, which node left (and which spare joined), and on which
node each incident was diagnosed. ``timeline`` computes the rows from the report's summary
(``attempts_detail``, ``crashes``, ``incidents``, ``ranks``) so tests can check them without
reading pixels; ``plot_timeline`` draws them as ``timeline.png``.

A node's attempts come from its ranks' ``rank_start`` records (``node_attempts``): a node
killed in attempt 0 has no bar in attempt 1, and a spare that joined has no bar before.
Without rank files every node is drawn in every attempt.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from steadytrain.printable import printable

__all__ = ["LITERAL_TEXT", "draw_timeline", "node_attempts", "plot_timeline", "timeline"]

# matplotlib settings under which every text is drawn as it is: a ``$`` in a node name is a
# dollar sign, not the start of mathtext (``$\foo$`` would fail the whole figure).
LITERAL_TEXT = {"text.parse_math": False}

_ATTEMPT_COLORS = ("#90caf9", "#a5d6a7", "#ffe082", "#ce93d8", "#80cbc4", "#ffab91")


def node_attempts(view: Any) -> dict[str, set[int]]:
    """``{node: {attempt, ...}}`` from a ``RanksView``: the attempts a node had ranks in."""
    out: dict[str, set[int]] = {}
    for summary in view.ranks.values():
        for a in summary.attempts:
            if a.get("node") is not None and a.get("attempt") is not None:
                out.setdefault(str(a["node"]), set()).add(int(a["attempt"]))
    return out


def _natural(name: str) -> list[Any]:
    """node-2 before node-10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _incident_nodes(a: dict[str, Any], rank_node: dict[int, str], nodes: list[str]) -> list:
    if a.get("nodes"):  # the engine's incidents name every node
        return sorted(set(a["nodes"]), key=_natural)
    if a.get("node"):
        return [a["node"]]
    ranks = a.get("ranks") or ([a["rank"]] if a.get("rank") is not None else [])
    found = sorted({rank_node[r] for r in ranks if r in rank_node}, key=_natural)
    return found or nodes  # not tied to a node (a shared slowdown): on every row


def timeline(
    summary: dict[str, Any], present: dict[str, set[int]] | None = None
) -> list[dict[str, Any]]:
    """One row per node (``node`` None: the run wrote no rank files), times in seconds since
    the first attempt began::

        {"node", "ranks": [...], "attempts": [{"attempt", "start", "end", "reason",
         "restored_step"}], "crashes": [{"attempt", "t", "step", "reason", "node_lost"}],
         "incidents": [{"index", "t", "step", "kind", "diagnosis", "everywhere"}]}

    ``present``: ``node_attempts(view)``; ``index`` is the incident's number (#n) in the
    report's table."""
    attempts = summary.get("attempts_detail") or []
    starts = [a["start_t"] for a in attempts if a.get("start_t") is not None]
    t0 = min(starts) if starts else 0.0
    rows_in = summary.get("ranks") or []
    rank_node = {r["rank"]: r["node"] for r in rows_in if r.get("node")}
    names = {n for r in rows_in for n in (r.get("nodes") or [r.get("node")]) if n}
    names |= set(present or {})
    nodes: list[Any] = sorted(names, key=_natural) or [None]
    last_attempt = max((int(a.get("attempt", i)) for i, a in enumerate(attempts)), default=0)

    def on(node: Any, attempt: int) -> bool:
        return node is None or not present or attempt in present.get(node, set())

    rows = []
    for node in nodes:
        row: dict[str, Any] = {
            "node": node,
            "ranks": sorted(
                r["rank"] for r in rows_in if node in (r.get("nodes") or [r.get("node")])
            ),
            "attempts": [],
            "crashes": [],
            "incidents": [],
        }
        for i, a in enumerate(attempts):
            k = int(a.get("attempt", i))
            if on(node, k) and a.get("start_t") is not None:
                row["attempts"].append(
                    {
                        "attempt": k,
                        "start": a["start_t"] - t0,
                        "end": (a.get("end_t") or a["start_t"]) - t0,
                        "reason": a.get("reason"),
                        "restored_step": a.get("restored_step"),
                    }
                )
        for c in summary.get("crashes") or []:
            k = int(c.get("attempt") or 0)
            if c.get("t") is None or not on(node, k):
                continue
            later = any(on(node, j) for j in range(k + 1, last_attempt + 1))
            row["crashes"].append(
                {
                    "attempt": k,
                    "t": c["t"] - t0,
                    "step": c.get("step"),
                    "reason": c.get("reason"),
                    # the job went on without this node (a lost machine)
                    "node_lost": bool(present) and k < last_attempt and not later,
                }
            )
        rows.append(row)
    for j, a in enumerate(summary.get("incidents") or [], 1):
        where = _incident_nodes(a, rank_node, nodes)
        if not set(where) & set(nodes):
            where = nodes  # a node without rank files: shown on every row, marked so
        for row in rows:
            if row["node"] in where:
                row["incidents"].append(
                    {
                        "index": j,
                        "t": None if a.get("t") is None else a["t"] - t0,
                        "step": a.get("step"),
                        "kind": a.get("kind"),
                        "diagnosis": a.get("diagnosis"),
                        "everywhere": where is nodes,
                    }
                )
    return rows


def plot_timeline(data: dict[str, Any], out: Path, plt: Any) -> str | None:
    """``timeline.png`` from the report's data (``report._read`` plus ``ranks``/``alerts``
    as ``build_report`` fills them); None when there is no attempt to draw."""
    section = data.get("ranks") or {}
    summary = {
        "attempts_detail": data["breakdown"].attempt_summaries,
        "crashes": data.get("crashes") or [],
        "incidents": data["incidents"] if "incidents" in data else data.get("alerts") or [],
        "ranks": section.get("ranks") or [],
    }
    view = section.get("view")
    rows = timeline(summary, node_attempts(view) if view is not None else None)
    if not any(r["attempts"] for r in rows):
        return None
    return draw_timeline(rows, out / "timeline.png", plt)


def draw_timeline(rows: list[dict[str, Any]], path: Path, plt: Any) -> str:
    """Draw ``timeline`` rows into the PNG ``path`` (an incident replay draws its own
    incident this way, next to the run's); returns the path. Node names and diagnoses come
    from records: drawn as literal text, control characters shown as escapes."""
    with plt.rc_context(LITERAL_TEXT):
        return _draw_timeline(rows, path, plt)


def _draw_timeline(rows: list[dict[str, Any]], path: Path, plt: Any) -> str:
    end = max((a["end"] for r in rows for a in r["attempts"]), default=0.0)
    unit, unit_name = (1.0, "seconds") if end < 600 else (60.0, "minutes")
    if end >= 36_000:
        unit, unit_name = 3600.0, "hours"

    fig, ax = plt.subplots(figsize=(11, min(10.0, 1.4 + 0.55 * len(rows))))
    labelled: set[str] = set()

    def once(name: str) -> str | None:
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for y, row in enumerate(rows):
        for a in row["attempts"]:
            x0, x1 = a["start"] / unit, a["end"] / unit
            color = _ATTEMPT_COLORS[a["attempt"] % len(_ATTEMPT_COLORS)]
            ax.barh(y, max(x1 - x0, 1e-9), left=x0, height=0.5, color=color, ec="#546e7a")
            text = f"attempt {a['attempt']}"
            if a["attempt"] > 0:
                text += f" (from step {a.get('restored_step') or 0})"
            ax.annotate(text, (x0, y - 0.3), fontsize=7, va="bottom", ha="left")
        for c in row["crashes"]:
            x = c["t"] / unit
            ax.plot([x], [y], "X", color="#212121", ms=9, label=once("crash"))
            text = f"step {c['step']}" + (": node lost" if c["node_lost"] else "")
            ax.annotate(text, (x, y + 0.12), fontsize=7, ha="right", va="top")
        level = 0
        for inc in row["incidents"]:
            if inc["t"] is None:
                continue
            x = inc["t"] / unit
            marker = "v" if not inc["everywhere"] else "d"
            ax.plot([x], [y], marker, color="#c62828", ms=8, label=once("incident #n"))
            ax.annotate(
                printable(f"#{inc['index']} {inc['diagnosis'] or inc['kind']}"),
                (x, y + 0.28 + 0.14 * (level % 3)),
                fontsize=7,
                color="#c62828",
                ha="left",
                va="top",
            )
            level += 1
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        [
            f"{printable(r['node'])}\nranks {', '.join(map(str, r['ranks']))}"
            if r["node"]
            else "all ranks"
            for r in rows
        ],
        fontsize=8,
    )
    ax.set_ylim(len(rows) - 0.4, -0.7)  # first node on top, room for the labels
    ax.set_xlim(left=0)
    ax.set_xlabel(f"{unit_name} since job start")
    ax.set_title("Per node: attempts (bars), crashes (X), incidents #n as in the table")
    if labelled:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path)
