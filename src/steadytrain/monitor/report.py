"""The run report: goodput across every restart, incidents with diagnoses, and plots.

``build_report(run_dir, out_dir)`` reads ``RUN_DIR/ledger.jsonl`` once and writes into
``out_dir`` (default ``RUN_DIR/report``):

* ``throughput.png``: tokens/s per GPU over time, the expected band, restarts, incidents;
* ``waits.png``: data wait and checkpoint blocking per step over time;
* ``goodput.png``: one bar, goodput and every badput bucket as a share of wall time;
* ``report.html``: one self-contained page (plots embedded, and linked to the PNG files);
* ``report.json``: the summary returned by ``build_report``.
"""

from __future__ import annotations

import base64
import html
import json
import os
from array import array
from pathlib import Path
from typing import Any

from steadytrain.errors import SteadyError
from steadytrain.monitor.goodput import BUCKETS, GoodputAccumulator
from steadytrain.monitor.ledger import iter_ledger, ledger_path
from steadytrain.storage.publish import publish_bytes

__all__ = ["build_report"]

_MAX_POINTS = 4000  # plot points; longer runs are averaged into time bins
_COLORS = {
    "goodput": "#2e7d32",
    "startup": "#90a4ae",
    "restore": "#607d8b",
    "data_wait": "#ef6c00",
    "checkpoint_block": "#6a1b9a",
    "lost_to_failures": "#c62828",
    "restart_gap": "#424242",
    "other": "#bdbdbd",
}


class _Series:
    """Per-step columns in compact arrays (a long run has millions of steps)."""

    def __init__(self) -> None:
        self.t = array("d")
        self.tps = array("d")
        self.data = array("d")
        self.ckpt = array("d")
        self.attempt = array("i")


def _read(run_dir: Path) -> dict[str, Any]:
    path = ledger_path(run_dir)
    if not path.exists():
        raise SteadyError(
            f"{path} does not exist: pass the run directory a GoodputMeter wrote "
            "(the one holding ledger.jsonl)"
        )
    acc = GoodputAccumulator()
    s = _Series()
    starts: list[dict[str, Any]] = []
    alerts: list[dict[str, Any]] = []
    checkpoints = 0
    world = 1
    band = None
    band_learned = None
    for rec in iter_ledger(path):
        acc.add(rec)
        kind = rec["type"]
        if kind == "step":
            step_s = float(rec.get("step_s") or 0.0)
            if step_s <= 0:
                continue
            s.t.append(float(rec["t"]))
            s.tps.append(float(rec.get("tokens") or 0) / step_s / world)
            s.data.append(float(rec.get("data_wait_s") or 0.0))
            s.ckpt.append(float(rec.get("checkpoint_block_s") or 0.0))
            s.attempt.append(len(starts) - 1)
        elif kind == "job_start":
            world = max(1, int(rec.get("world_size") or 1))
            starts.append(rec)
            if rec.get("expected_tokens_per_s"):
                band = rec["expected_tokens_per_s"]
        elif kind == "alert":
            alerts.append(rec)
            ev = rec.get("evidence") or {}
            if band is None and rec.get("kind") == "throughput_band" and ev.get("band"):
                learned = ev["band"]  # no band configured: show the one learned in-run
                band_learned = [learned[0], learned[1] if learned[1] != float("inf") else None]
        elif kind == "checkpoint" and rec.get("ok", True):
            checkpoints += 1
    if not starts:
        raise SteadyError(f"{path} has no job_start record: was GoodputMeter.job_start() called?")
    return {
        "breakdown": acc.breakdown(),
        "t0": acc.start,
        "series": s,
        "starts": starts,
        "alerts": alerts,
        "checkpoints": checkpoints,
        "band": band or band_learned,
        "band_kind": "expected" if band else ("learned" if band_learned else None),
    }


def _unit(data: dict[str, Any]) -> tuple[float, str]:
    total = data["breakdown"].total_s
    if total < 600:
        return 1.0, "seconds"
    if total < 36_000:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _segments(s: _Series, y: array, t0: float, unit: float) -> list[tuple[list, list]]:
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
    for j, a in enumerate(data["alerts"], 1):
        x = (a["t"] - t0) / unit
        ax.axvline(x, color="#c62828", lw=1, alpha=0.7)
        if label:
            ax.annotate(
                f"#{j}",
                (x, 0.02),
                xycoords=("data", "axes fraction"),
                color="#c62828",
                fontsize=8,
            )


def _plots(data: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in threads and on servers
    import matplotlib.pyplot as plt

    s, t0 = data["series"], data["t0"]
    unit, unit_name = _unit(data)
    paths = {}

    fig, ax = plt.subplots(figsize=(10, 4))
    top = 0.0
    for i, (xs, ys) in enumerate(_segments(s, s.tps, t0, unit)):
        ax.plot(xs, ys, lw=1.2, color="#1565c0", label="tokens/s per GPU" if i == 0 else None)
        top = max([top, *ys])
    if data["band"]:
        lo, hi = data["band"]
        ax.axhspan(
            lo,
            hi if hi is not None else max(top, lo) * 1.05,
            color="#2e7d32",
            alpha=0.12,
            label=f"{data['band_kind']} band",
        )
    _mark_events(ax, data, label=True, unit=unit)
    ax.set_xlabel(f"{unit_name} since job start")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput (red lines: incidents #n, dashed: restarts)")
    ax.legend(loc="lower right", fontsize=8)
    paths["throughput"] = out / "throughput.png"
    fig.tight_layout()
    fig.savefig(paths["throughput"], dpi=100)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for xs, ys in _segments(s, s.data, t0, unit):
        a1.plot(xs, ys, lw=1.2, color=_COLORS["data_wait"])
    a1.set_ylabel("data wait (s/step)")
    for xs, ys in _segments(s, s.ckpt, t0, unit):
        a2.plot(xs, ys, lw=1.2, color=_COLORS["checkpoint_block"])
    a2.set_ylabel("checkpoint block (s/step)")
    a2.set_xlabel(f"{unit_name} since job start")
    for ax in (a1, a2):
        _mark_events(ax, data, label=ax is a1, unit=unit)
        ax.set_ylim(bottom=0)
    a1.set_title("Where the loop waited")
    paths["waits"] = out / "waits.png"
    fig.tight_layout()
    fig.savefig(paths["waits"], dpi=100)
    plt.close(fig)

    b = data["breakdown"]
    fig, ax = plt.subplots(figsize=(10, 3))
    left = 0.0
    parts = [("goodput", b.goodput)] + list(b.badput_fraction().items())
    for name, frac in parts:
        if frac <= 0:
            continue
        ax.barh(0, frac, left=left, color=_COLORS[name], label=f"{name} {frac:.1%}")
        left += frac
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("share of job wall time")
    ax.set_title(f"Goodput {b.goodput:.1%} over {b.total_s / 60:.1f} min, {b.attempts} attempt(s)")
    # The legend goes in its own strip under the axis label (inside the axes it would hide
    # the thin segments; overlapping the axis it hides the tick labels).
    fig.subplots_adjust(left=0.03, right=0.97, top=0.85, bottom=0.5)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    paths["goodput"] = out / "goodput.png"
    fig.savefig(paths["goodput"], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return {k: str(v) for k, v in paths.items()}


def _html(summary: dict[str, Any], out: Path) -> Path:
    e = html.escape

    def img(key: str) -> str:
        p = Path(summary["plots"][key])
        b64 = base64.b64encode(p.read_bytes()).decode()
        return (
            f'<figure><img alt="{key}" src="data:image/png;base64,{b64}">'
            f'<figcaption><a href="{e(p.name)}">{e(p.name)}</a></figcaption></figure>'
        )

    rows = "".join(
        f"<tr><td>{e(k)}</td><td>{summary['badput_s'][k]:.1f} s</td>"
        f"<td>{summary['badput'][k]:.1%}</td></tr>"
        for k in BUCKETS
    )
    inc = "".join(
        f"<tr><td>{i}</td><td>{a['minutes']:.1f}</td><td>{a.get('step')}</td>"
        f"<td>{e(str(a['kind']))}</td><td><b>{e(str(a['diagnosis']))}</b></td>"
        f"<td>{e(str(a['message']))}</td><td>{e(str(a.get('next', '')))}</td></tr>"
        for i, a in enumerate(summary["incidents"], 1)
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>steadytrain report: {e(summary["run_dir"])}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;font-size:14px}}img{{max-width:100%}}h1 span{{color:#2e7d32}}</style>
</head><body>
<h1>Goodput <span>{summary["goodput"]:.1%}</span></h1>
<p>{e(summary["run_dir"])}: {summary["total_s"] / 60:.1f} min of wall time,
{summary["attempts"]} attempt(s), {summary["steps_kept"]} steps kept,
{summary["steps_lost"]} redone after failures, {summary["checkpoints"]} checkpoints committed;
recovery point age at the end {summary["recovery_point_age_s"] or 0:.0f} s.</p>
{img("goodput")}
<h2>Where the time went</h2>
<table><tr><th>bucket</th><th>time</th><th>share</th></tr>
<tr><td>goodput</td><td>{summary["goodput_s"]:.1f} s</td><td>{summary["goodput"]:.1%}</td></tr>
{rows}</table>
<h2>Incidents</h2>
{"<p>None.</p>" if not inc else ""}
{"<table><tr><th>#</th><th>min</th><th>step</th><th>alert</th><th>diagnosis</th><th>what</th><th>look at next</th></tr>" + inc + "</table>" if inc else ""}
<h2>Throughput</h2>{img("throughput")}
<h2>Data wait and checkpoint blocking</h2>{img("waits")}
<p><small>Definitions: docs/monitoring.md (buckets of Google's ml-goodput-measurement).
</small></p></body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def build_report(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Write the plots, the HTML page and report.json; return the summary dict."""
    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    data = _read(run)
    b = data["breakdown"]
    t0 = data["t0"]
    summary = b.to_dict()
    summary.pop("attempt_summaries")
    summary.update(
        {
            "run_dir": str(run),
            "attempts_detail": b.attempt_summaries,
            "checkpoints": data["checkpoints"],
            "expected_tokens_per_s": data["band"],
            "incidents": [
                {
                    "minutes": (a["t"] - t0) / 60,
                    **{k: a.get(k) for k in ("t", "step", "kind", "diagnosis", "message", "next")},
                }
                for a in data["alerts"]
            ],
        }
    )
    summary["plots"] = _plots(data, out)
    summary["html"] = str(_html(summary, out))
    summary["json"] = str(out / "report.json")
    # Atomic, so a reader never parses half a report; not fsync'd: rerunning
    # ``steadytrain report`` rebuilds it from the ledger.
    publish_bytes(
        str(out / "report.json"), json.dumps(summary, indent=2, default=str), durable=False
    )
    return summary
