"""The run report's plots: throughput with its bands and incidents, the loop's waits, the
goodput bar, and (from ``report.ranks`` and ``report.timeline``) the rank heatmaps and the
per-node timeline. ``plots(data, out, drawn)`` takes the data ``report.build_report``
assembles; every figure of the goodput bar comes from ``data["breakdown"]``, the report's
one ``Breakdown`` (never recomputed here), and ``drawn`` records what each plot drew."""

from __future__ import annotations

import logging
from array import array
from pathlib import Path
from typing import Any

from steadytrain.extras import require
from steadytrain.printable import printable
from steadytrain.report.ranks import per_unit, plot_heatmaps
from steadytrain.report.timeline import LITERAL_TEXT, plot_timeline

__all__ = ["plots"]

log = logging.getLogger(__name__)

_MAX_POINTS = 4000  # plot points; longer runs are averaged into time bins
_COLORS = {
    "goodput": "#2e7d32",
    "startup": "#90a4ae",
    "restore": "#607d8b",
    "data_wait": "#ef6c00",
    "checkpoint_block": "#6a1b9a",
    "eval": "#1565c0",
    "slowdown": "#ab47bc",
    "lost_to_failures": "#c62828",
    "restart_gap": "#424242",
    "other": "#bdbdbd",
    "straggler_wait": "#f9a825",
    "straggler_compute": "#8d6e63",
    "records_lost": "#000000",
}


def _unit(data: dict[str, Any]) -> tuple[float, str]:
    total = data["breakdown"].total_s
    if total < 600:
        return 1.0, "seconds"
    if total < 36_000:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _segments(s: Any, y: array, t0: float, unit: float) -> list[tuple[list, list]]:
    """One (x, y) line per attempt, so restart gaps are not drawn as slopes; long runs are
    averaged into at most _MAX_POINTS bins, short noisy ones smoothed over a few steps."""
    out = []
    n = len(s.t)
    k = max(1, -(-n // _MAX_POINTS), n // 100)
    i = 0
    while i < n:
        j = i
        while j < n and s.attempt[j] == s.attempt[i]:
            j += 1
        xs, ys = [], []
        for a in range(i, j, k):
            b = min(j, a + k)
            xs.append((sum(s.t[a:b]) / (b - a) - t0) / unit)
            ys.append(sum(y[a:b]) / (b - a))
        out.append((xs, ys))
        i = j
    return out


def _mark_events(ax: Any, data: dict[str, Any], label: bool, unit: float) -> None:
    t0 = data["t0"]
    for i, st in enumerate(data["starts"][1:], 1):
        x = (st["t"] - t0) / unit
        ax.axvline(x, color="#424242", ls="--", lw=1)
        if label:
            ax.annotate(
                f"restart {i}\n(from step {st.get('restored_step', 0)})",
                (x, 1),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                va="top",
                ha="left",
            )
    for c in data.get("crashes", []):
        if c.get("t") is None:
            continue
        x = (c["t"] - t0) / unit
        ax.axvline(x, color="#212121", ls=":", lw=1.5)
        if label:
            ax.annotate(
                f"crash\n(step {c['step']})",
                (x, 0.75),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                ha="right",
            )
    # Incident labels sit at the bottom of the axes (the legend is outside them); labels
    # of incidents closer than ~3 % of the width stack upwards instead of overprinting.
    lo, hi = ax.get_xlim()
    last_x, level = None, 0
    marks = sorted(
        ((a["t"] - t0) / unit, j)
        # the report's incidents (the engine's, numbered as in the table)
        for j, a in enumerate(data["incidents"] if "incidents" in data else data["alerts"], 1)
        if a.get("t") is not None  # a post-hoc finding past the ledger's last step
    )
    for x, j in marks:
        ax.axvline(x, color="#c62828", lw=1, alpha=0.7)
        if not label:
            continue
        close = last_x is not None and x - last_x < 0.03 * (hi - lo)
        level = level + 1 if close else 0
        last_x = x
        ax.annotate(
            f"#{j}",
            (x, 0.02 + 0.07 * (level % 6)),
            xycoords=("data", "axes fraction"),
            xytext=(2, 0),
            textcoords="offset points",
            color="#c62828",
            fontsize=8,
        )


def _shade_bands(ax: Any, data: dict[str, Any], top: float, unit: float) -> None:
    """Each attempt's band over that attempt's steps only (see ``report._read``)."""
    t0, starts, s = data["t0"], data["starts"], data["series"]
    last = {a: t for a, t in zip(s.attempt, s.t, strict=True)}  # each attempt's last step
    labelled = set()
    for i, entry in enumerate(data["bands"]):
        if entry is None or i not in last:
            continue
        lo, hi = entry["band"]
        x0, x1 = (starts[i]["t"] - t0) / unit, (last[i] - t0) / unit
        kind = entry["kind"]
        ax.fill_between(
            [x0, x1],
            lo,
            hi if hi is not None else max(top, lo) * 1.05,
            color="#2e7d32",
            alpha=0.12,
            lw=0,
            label=None
            if kind in labelled
            else f"{kind} band" + (" (each attempt's own)" if kind == "learned" else ""),
        )
        labelled.add(kind)


def goodput_bar(b: Any) -> dict[str, Any]:
    """What ``goodput.png`` draws from the breakdown ``b``: the title's goodput and each
    segment's share, in order (zero shares are not drawn)."""
    shares = b.shares()
    return {
        "goodput": shares["goodput"],
        "segments": {k: v for k, v in shares.items() if v > 0},
        "title": f"Goodput {shares['goodput']:.1%} over {b.total_s / 60:.1f} min, "
        f"{b.attempts} attempt(s)",
    }


# Every PNG a report draws, in the page's order (``plots``).
PLOT_NAMES = ("throughput", "waits", "goodput", "ranks", "timeline")


def plots(
    data: dict[str, Any],
    out: Path,
    drawn: dict[str, Any] | None = None,
    missing: dict[str, str] | None = None,
) -> dict[str, str]:
    """Every PNG of the report into ``out``; their paths by name. ``drawn`` (when given)
    receives what they drew: ``goodput`` (``goodput_bar``), ``ranks`` (the heatmap's row
    labels). A plot that cannot be drawn is left out, named in ``missing`` (``{name: why}``)
    and warned about; the others are still drawn: the report never fails for one picture."""
    drawn = drawn if drawn is not None else {}
    missing = missing if missing is not None else {}
    matplotlib = require("matplotlib", "the report's plots")

    matplotlib.use("Agg")  # no display; safe in threads and on servers
    import matplotlib.pyplot as plt

    unit = _unit(data)
    marks = {
        "restarts": [int(st.get("restored_step") or 0) for st in data["starts"][1:]],
        "crashes": [c["step"] for c in data.get("crashes", [])],
    }
    figures = {
        "throughput": lambda: _throughput(data, out, plt, unit),
        "waits": lambda: _waits(data, out, plt, unit),
        "goodput": lambda: _goodput(data, out, plt, drawn),
        "ranks": lambda: plot_heatmaps(data["ranks"], marks, data["device"], out, plt, drawn),
        # per node: attempts, crashes, incidents
        "timeline": lambda: plot_timeline(data, out, plt),
    }
    assert tuple(figures) == PLOT_NAMES
    paths = {}
    for name, draw in figures.items():
        path = _drawn(name, draw, plt, missing)
        if path is not None:
            paths[name] = str(path)
    return paths


def _drawn(name: str, draw: Any, plt: Any, missing: dict[str, str]) -> Any:
    """``draw()`` with every text literal (``LITERAL_TEXT``: a node name ``$\\foo$`` is
    printed, not parsed as mathtext), or None when it fails, with ``missing[name]`` saying
    why (the figures it opened are closed; a caller's own figures are left alone)."""
    before = set(plt.get_fignums())
    try:
        with plt.rc_context(LITERAL_TEXT):
            return draw()
    except Exception as exc:  # noqa: BLE001 - any failure loses this picture, not the report
        for num in set(plt.get_fignums()) - before:
            plt.close(num)
        text = " ".join(str(exc).split())[:300]  # one line (mathtext errors span several)
        missing[name] = printable(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        log.warning("report: %s.png not drawn (%s); the rest of the report is", name, missing[name])
        return None


def _throughput(data: dict[str, Any], out: Path, plt: Any, unit: tuple[float, str]) -> Path:
    s, t0 = data["series"], data["t0"]
    per = f"tokens/s per {per_unit(data['device'])}"  # "per GPU" only on a CUDA run
    fig, ax = plt.subplots(figsize=(11, 4))
    top = 0.0
    for i, (xs, ys) in enumerate(_segments(s, s.tps, t0, unit[0])):
        ax.plot(xs, ys, lw=1.2, color="#1565c0", label=per if i == 0 else None)
        top = max([top, *ys])
    _shade_bands(ax, data, top, unit[0])
    _mark_events(ax, data, label=True, unit=unit[0])
    ax.set_xlabel(f"{unit[1]} since job start")
    ax.set_ylabel(per)
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput (red lines: incidents #n, dashed: restarts, dotted: crashes)")
    # Outside the axes: inside, it covered the incident labels along the bottom.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)
    path = out / "throughput.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _waits(data: dict[str, Any], out: Path, plt: Any, unit: tuple[float, str]) -> Path:
    s, t0 = data["series"], data["t0"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for xs, ys in _segments(s, s.data, t0, unit[0]):
        a1.plot(xs, ys, lw=1.2, color=_COLORS["data_wait"])
    a1.set_ylabel("data wait (s/step)")
    for xs, ys in _segments(s, s.ckpt, t0, unit[0]):
        a2.plot(xs, ys, lw=1.2, color=_COLORS["checkpoint_block"])
    a2.set_ylabel("checkpoint block (s/step)")
    a2.set_xlabel(f"{unit[1]} since job start")
    for ax in (a1, a2):
        _mark_events(ax, data, label=ax is a1, unit=unit[0])
        ax.set_ylim(bottom=0)
    a1.set_title("Where the loop waited")
    path = out / "waits.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _goodput(data: dict[str, Any], out: Path, plt: Any, drawn: dict[str, Any]) -> Path:
    bar = drawn["goodput"] = goodput_bar(data["breakdown"])
    fig, ax = plt.subplots(figsize=(10, 3))
    left = 0.0
    for name, frac in bar["segments"].items():
        color = _COLORS.get(name, "#8d6e63")  # a bucket added later still gets drawn
        ax.barh(0, frac, left=left, color=color, label=f"{name} {frac:.1%}")
        left += frac
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("share of job wall time")
    ax.set_title(bar["title"])
    # The legend goes in its own strip under the axis label (inside the axes it would hide
    # the thin segments; overlapping the axis it hides the tick labels).
    fig.subplots_adjust(left=0.03, right=0.97, top=0.85, bottom=0.5)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    path = out / "goodput.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
