"""The run report: goodput across every restart, incidents with diagnoses, and plots.

``build_report(run_dir, out_dir)`` reads ``RUN_DIR/ledger.jsonl`` once and writes into
``out_dir`` (default ``RUN_DIR/report``):

* ``throughput.png``: tokens/s per GPU over time, the expected band, restarts, incidents;
* ``waits.png``: data wait and checkpoint blocking per step over time;
* ``goodput.png``: one bar, goodput and every badput bucket as a share of wall time;
* ``ranks.png``: rank x step heatmaps of data wait and step time (``report/ranks.py``);
* ``timeline.png``: one row per node: attempts, crashes, incidents (``report/timeline.py``);
* ``report.html``: one self-contained page (plots embedded, and linked to the PNG files);
* ``report.json``: the summary returned by ``build_report``.

One set of numbers: the goodput breakdown is computed once (``breakdown``: rank 0's ledger
through ``GoodputAccumulator``, then what only the report sees charged into buckets of its
own: ``straggler_wait`` from the rank files, ``records_lost`` from the ledger's lost spans).
That one ``Breakdown`` is the heading, the bucket table (``bucket_rows``, text and HTML), the
goodput bar (``report.plots``, which records what it drew under ``plotted``) and the JSON;
no view computes a share of its own.
"""

from __future__ import annotations

import base64
import json
import os
from array import array
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

from steadytrain.diagnose.engine import diagnose
from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import load
from steadytrain.diagnose.job_state import job_state
from steadytrain.errors import SteadyError
from steadytrain.monitor.goodput import Breakdown, GoodputAccumulator
from steadytrain.monitor.ledger import ledger_path
from steadytrain.monitor.ranks import RanksView
from steadytrain.monitor.records import Rejects, check_record
from steadytrain.monitor.records_lost import LostSpans, lost_warning
from steadytrain.printable import html_text
from steadytrain.redact import redact
from steadytrain.report.plots import PLOT_NAMES
from steadytrain.report.plots import plots as _plots
from steadytrain.report.ranks import (
    INCIDENT_KEYS,
    attach_ranks,
    charge_straggler_wait,
    crashes,
    node_rows,
    rank_section,
    ranks_html,
    where,
    who,
)
from steadytrain.report.recoveries import recoveries_html, recovery_rows
from steadytrain.report.restarts import attempt_rows, restart_rows, restarts_html
from steadytrain.report.restores import RestoreLog, restores_html
from steadytrain.storage.publish import publish_bytes

__all__ = [
    "breakdown",
    "bucket_rows",
    "build_report",
    "capped_lines",
    "checkpoint_words",
    "incident_rows",
    "state_text",
    "data_bound",
    "goodput_class",
    "rejected_lines",
    "run_breakdown",
    "slowdown_note",
    "GOODPUT_GOOD",
    "GOODPUT_FAIR",
]

# The page's goodput heading is green only when goodput is good: at or above 90 % (Llama 3
# reached ~91 % with 30-minute checkpoints), amber from 70 %, red below.
GOODPUT_GOOD = 0.90
GOODPUT_FAIR = 0.70
_BAND = {"b": {"band": "!band"}}


def _band(v: Any) -> list[Any] | None:
    """A learned band read back from an alert's evidence (``[low, high]``, ``high`` inf
    or null when open), or None when it is not one: evidence is free-form."""
    if not isinstance(v, list) or len(v) != 2:
        return None
    v = [v[0], None if v[1] == float("inf") else v[1]]
    return v if check_record({"type": "b", "band": v}, _BAND) is None else None


class _Series:
    """Per-step columns in compact arrays (a long run has millions of steps)."""

    def __init__(self) -> None:
        self.t = array("d")
        self.tps = array("d")
        self.data = array("d")
        self.ckpt = array("d")
        self.attempt = array("i")
        self.step = array("q")


def _read(
    run_dir: Path, rejects: Rejects | None = None
) -> Generator[None, dict[str, Any] | None, dict[str, Any]]:
    """The report's fold of rank 0's ledger, fed the records ``diagnose.inputs.load`` reads
    (``send`` each, then None; the data comes back in ``StopIteration.value``): a push
    consumer, so the ledger is read once, for the engine and the report alike."""
    path = ledger_path(run_dir)
    if not path.exists():
        raise SteadyError(
            f"{path} does not exist: pass the run directory a GoodputMeter wrote "
            "(the one holding ledger.jsonl)"
        )
    rejects = rejects if rejects is not None else Rejects()
    acc = GoodputAccumulator()
    lost = LostSpans()  # records_lost: what a failing disk took (monitor/records_lost.py)
    restores = RestoreLog()  # restores by tier, memory snapshots (report/restores.py)
    s = _Series()
    starts: list[dict[str, Any]] = []
    alerts: list[dict[str, Any]] = []
    # One band per attempt, as the alert engine used it: the configured one from that
    # attempt's job_start, else the one it learned from that attempt's own baseline (read
    # back from its throughput alert). Shading one band across every attempt would
    # contradict the incidents of the others.
    bands: list[dict[str, Any] | None] = []
    ends: dict[int, dict[str, Any]] = {}  # attempt index -> its job_end
    world = 1
    band = None
    band_learned = None
    while (rec := (yield)) is not None:  # invalid records were skipped and counted by load
        acc.add(rec)
        lost.add(rec)
        restores.add(rec)
        kind = rec["type"]
        if kind == "step":
            step_s = float(rec.get("step_s") or 0.0)
            if step_s < 1e-9:  # no duration to divide by (a denormal would plot inf)
                continue
            s.t.append(float(rec["t"]))
            s.tps.append(float(rec.get("tokens") or 0) / step_s / world)
            s.data.append(float(rec.get("data_wait_s") or 0.0))
            s.ckpt.append(float(rec.get("checkpoint_block_s") or 0.0))
            s.attempt.append(len(starts) - 1)
            s.step.append(int(rec.get("step") or 0))
        elif kind == "job_end" and starts:
            ends[len(starts) - 1] = rec
        elif kind == "job_start":
            world = max(1, int(rec.get("world_size") or 1))
            starts.append(rec)
            expected = rec.get("expected_tokens_per_s")
            bands.append({"band": list(expected), "kind": "expected"} if expected else None)
            if expected:
                band = expected
        elif kind == "alert":
            alerts.append(rec)
            ev = rec.get("evidence") or {}
            learned = _band(ev.get("band"))
            if rec.get("kind") == "throughput_band" and learned and bands:
                # no band configured: the one learned in this attempt
                if bands[-1] is None:
                    bands[-1] = {"band": learned, "kind": "learned"}
                if band is None and band_learned is None:
                    band_learned = learned
    if not starts:
        refused = rejects.to_dict().get(path.name)
        why = (
            f" ({refused['count']} record(s) skipped as invalid: {', '.join(refused['reasons'])})"
            if refused
            else ""
        )
        raise SteadyError(
            f"{path} has no valid job_start record{why}: was GoodputMeter.job_start() called? "
            "The ledger must be a regular file of JSON lines written by the meter"
        )
    return {
        # rank 0's ledger alone; build_report charges what only the report sees (breakdown)
        "ledger_breakdown": acc.breakdown(),
        "t0": acc.start,
        "series": s,
        "starts": starts,
        "alerts": alerts,
        "records_lost": lost.spans,
        "restores": restores,
        "band": band or band_learned,
        "bands": bands,
        "device": next((st.get("device") for st in reversed(starts) if st.get("device")), None),
        "crashes": crashes(starts, ends, s),
        "band_kind": "expected" if band else ("learned" if band_learned else None),
    }


def incident_rows(incidents: list[Incident], t0: float | None) -> list[dict[str, Any]]:
    """The engine's incidents as the report prints them: ``Incident.to_dict()`` plus the
    keys the report's readers knew before the engine (``step`` = first_step, ``node`` (the
    first node), ``rank`` (the only rank), ``diagnosis`` = kind, ``next`` = advice) and
    ``minutes`` since the run began."""
    out = []
    for inc in incidents:
        d = inc.to_dict()
        d.update(
            step=inc.first_step,
            node=inc.nodes[0] if inc.nodes else None,
            rank=inc.ranks[0] if len(inc.ranks) == 1 else None,
            diagnosis=inc.kind,
            next=inc.advice,
            minutes=None if inc.t is None or t0 is None else (inc.t - t0) / 60,
        )
        out.append(d)
    return out


def breakdown(
    ledger: Breakdown,
    view: RanksView,
    records_lost: list[dict[str, Any]],
    incidents: Iterable[Incident | dict[str, Any]],
) -> Breakdown:
    """THE breakdown of the report: rank 0's ledger (``ledger``) with ``straggler_wait``
    (rank 0 waiting inside a collective for a slower rank: its data wait from the rank
    files ``view``, its slow compute from the engine's ``incidents``; out of goodput) and
    ``records_lost`` (wall time whose ledger records a failing disk dropped; out of
    ``other``, which is where that time had fallen) charged into buckets of their own.
    Computed once by ``build_report`` (and by ``run_breakdown`` for the planner); every view
    prints it."""
    b = charge_straggler_wait(ledger, view, incidents)
    lost_s = sum(
        sp["span_s"] or 0.0
        for sp in records_lost
        if (sp.get("file") or "ledger.jsonl").endswith("ledger.jsonl")
    )
    if lost_s > 0:
        b = b.charged("records_lost", lost_s, source="other")
    return b


def run_breakdown(
    run_dir: str | os.PathLike[str],
    ledger: Breakdown,
    records_lost: list[dict[str, Any]],
    restarts: list[dict[str, Any]] | None = None,
) -> Breakdown:
    """The report's breakdown of ``run_dir`` (``breakdown``) from what a caller already
    read of its ledger (rank 0's ``ledger`` breakdown and its lost spans): ``plan --from-run`` plans from the goodput the report prints. Invalid rank
    records are skipped without a second warning. ``restarts``: a list to extend with the
    report's restart rows (``report/restarts.py``), from the same read."""
    records = load(run_dir, Rejects(warn=False))  # one read of the rank files and verdicts
    if restarts is not None:
        restarts.extend(restart_rows(records))
    return breakdown(ledger, records.view, records_lost, diagnose(records))


def capped_lines(summary: dict[str, Any]) -> list[str]:
    """One line per charge the breakdown could not make in full (``capped``): a goodput
    of 0.0 % (or a bucket at 0) is then a cap, and the line says by how much."""
    out = []
    for bucket, c in (summary.get("capped") or {}).items():
        src = "rank 0's productive time" if c.get("source") == "goodput" else c.get("source")
        out.append(
            f"{bucket} capped at {src}: {c['measured_s']:.1f} s measured, "
            f"{c['charged_s']:.1f} s charged ({c['measured_s'] - c['charged_s']:.1f} s "
            "not charged, so goodput is at most what it shows)"
        )
    return out


def bucket_rows(summary: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The bucket table every view prints: ``(name, seconds, share of wall time)`` for
    goodput and every bucket of the breakdown (zero ones too), in the breakdown's order,
    then ``("total", total_s, sum of the shares)`` -- 100 % unless the figures are broken."""
    rows = [("goodput", float(summary["goodput_s"]), float(summary["goodput"]))]
    rows += [(k, float(v), float(summary["badput"][k])) for k, v in summary["badput_s"].items()]
    rows.append(("total", float(summary["total_s"]), sum(r[2] for r in rows)))
    return rows


def data_bound(summary: dict[str, Any]) -> dict[str, Any]:
    """The job's data-bound time and who caused it (docs/monitoring.md, "Which rank's
    data wait"): ``data_wait`` (rank 0's own ``next()``) plus ``straggler_wait`` (rank 0
    waiting for a slower rank's ``next()``) is each step at its slowest rank's data wait;
    ``slowest`` is the (rank, node) line of the ranks table that waited the largest share of
    its own step time (None without rank files)."""
    bad = summary["badput_s"]
    s = float(bad.get("data_wait", 0.0)) + float(bad.get("straggler_wait", 0.0))
    total = float(summary["total_s"])
    lines = node_rows(summary.get("ranks") or [])
    worst = max(lines, key=lambda r: r["data_wait_share"], default=None)
    return {
        "s": s,
        "share": s / total if total > 0 else 0.0,
        "slowest": None
        if worst is None
        else {k: worst[k] for k in ("rank", "node", "nodes", "data_wait_s", "data_wait_share")},
    }


def slowdown_note(summary: dict[str, Any]) -> str | None:
    """The words under the bucket table when ``slowdown`` reads 0 for want of a baseline
    (no step outside a write, in this attempt or an earlier one): unmeasured, not zero."""
    n = summary.get("slowdown_unmeasured_steps") or 0
    if not n:
        return None
    return (
        f"slowdown unmeasured for {n} step(s): no step ran without a checkpoint write in "
        "flight, so there was no baseline step time to compare them with"
    )


def rejected_lines(summary: dict[str, Any]) -> list[str]:
    """One line per file with records skipped as invalid (``rejected_records``), and one
    when the records claimed more time than the wall clock (``overbooked_s``)."""
    out = []
    for name, r in (summary.get("rejected_records") or {}).items():
        why = ", ".join(f"{k} x{n}" for k, n in r["reasons"].items())
        out.append(f"skipped as invalid: {r['count']} record(s) of {name}: {why}")
    if summary.get("overbooked_s"):
        out.append(
            f"the records claim {summary['overbooked_s']:.1f} s more than the wall time: "
            "every figure was scaled to fit (a corrupt ledger or a broken clock)"
        )
    return out


def _steps(a: dict[str, Any]) -> str:
    """ "12-40", "12", or "" for an incident's step span."""
    first, last = a.get("first_step"), a.get("last_step")
    if first is None:
        return ""
    return str(first) if last in (None, first) else f"{first}-{last}"


def state_text(summary: dict[str, Any]) -> str:
    """The report's first line: the job's state (``job_state``)."""
    state = summary.get("job_state") or {}
    return str(state.get("text") or "job state unknown (no attempt in the records)")


def state_class(summary: dict[str, Any]) -> str:
    """The state line's colour: a job stopped by failures is red, a running one amber."""
    state = summary.get("job_state") or {}
    if state.get("state") == "stopped" and state.get("cause") == "failures":
        return "poor"
    return "fair" if state.get("state") == "running" else "good"


def checkpoint_words(summary: dict[str, Any]) -> str:
    """ "12 checkpoints committed", and how many of them only a restore proves."""
    n, k = summary.get("checkpoints") or 0, summary.get("checkpoints_reconciled") or 0
    out = f"{n} checkpoint{'' if n == 1 else 's'} committed"
    if k:
        out += f" ({k} known from a restore: the ledger lost {'its' if k == 1 else 'their'} record)"
    return out


def goodput_class(goodput: float) -> str:
    """The heading's colour class: "good" (green) from GOODPUT_GOOD, "fair" (amber) from
    GOODPUT_FAIR, else "poor" (red): 4.5 % is never shown in green."""
    if goodput >= GOODPUT_GOOD:
        return "good"
    return "fair" if goodput >= GOODPUT_FAIR else "poor"


def _html(summary: dict[str, Any], out: Path) -> Path:
    e = html_text  # every text from records: control characters shown, then HTML-escaped

    def img(key: str) -> str:
        if key not in summary["plots"]:  # not drawn: the page says which and why
            why = (summary.get("plots_missing") or {}).get(key)
            return f'<p class="poor">{e(key)}.png not drawn: {e(why)}</p>' if why else ""
        p = Path(summary["plots"][key])
        b64 = base64.b64encode(p.read_bytes()).decode()
        return (
            f'<figure><img alt="{key}" src="data:image/png;base64,{b64}">'
            f'<figcaption><a href="{e(p.name)}">{e(p.name)}</a></figcaption></figure>'
        )

    rows = "".join(
        f"<tr><td>{'<b>total</b>' if k == 'total' else e(k)}</td><td>{sec:.1f} s</td>"
        f"<td>{share:.1%}</td></tr>"
        for k, sec, share in bucket_rows(summary)
    )
    db = summary["data_bound"]
    slow = db["slowest"]
    bound = (
        f"<p>Data-bound (data_wait + straggler_wait: each step at its slowest rank's data "
        f"wait): {db['s']:.1f} s, {db['share']:.1%} of the wall time"
        + (
            f"; most: rank {slow['rank']} on {e(str(slow['node']))} waited "
            f"{slow['data_wait_share']:.1%} of its step time"
            if slow
            else ""
        )
        + ".</p>"
    )
    inc = "".join(
        f"<tr><td>{i}</td><td>{'' if a['minutes'] is None else format(a['minutes'], '.1f')}</td>"
        f"<td><b>{e(str(a['kind']))}</b></td><td>{e(where(a))}</td>"
        f"<td>{_steps(a)}</td><td>{a['lost_s']:.1f} s</td>"
        f"<td>{e(str(a['message']))}</td><td>{e(str(a.get('advice', '')))}</td></tr>"
        for i, a in enumerate(summary["incidents"], 1)
    )
    alerts = "".join(
        f"<tr><td>{'' if a['minutes'] is None else format(a['minutes'], '.1f')}</td>"
        f"<td>{e(a.get('step'))}</td><td>{e(who(a))}</td><td>{e(str(a['kind']))}</td>"
        f"<td>{e(str(a['diagnosis']))}</td><td>{e(str(a['message']))}</td></tr>"
        for a in summary["alerts"]
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>steadytrain report: {e(summary["run_dir"])}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;font-size:14px}}img{{max-width:100%}}.good{{color:#2e7d32}}
.fair{{color:#ef6c00}}.poor{{color:#c62828}}</style>
</head><body>
<p class="job-state {state_class(summary)}"><b>{e(state_text(summary))}</b></p>
<h1>Goodput <span class="{goodput_class(summary["goodput"])}">{summary["goodput"]:.1%}</span></h1>
<p>{e(summary["run_dir"])}: {summary["total_s"] / 60:.1f} min of wall time,
{summary["attempts"]} attempt(s), {summary["steps_kept"]} steps kept,
{summary["steps_lost"]} redone after failures, {checkpoint_words(summary)};
recovery point age at the end {summary["recovery_point_age_s"] or 0:.0f} s.</p>
{"".join(f'<p class="poor">{e(w)}</p>' for w in lost_warning(summary["records_lost"]))}
{img("goodput")}
<h2>Where the time went</h2>
<table class="buckets"><tr><th>bucket</th><th>time</th><th>share</th></tr>
{rows}</table>
{bound}
{f"<p>{e(note)}</p>" if (note := slowdown_note(summary)) else ""}
{"".join(f'<p class="poor">{e(c)}</p>' for c in capped_lines(summary))}
{"".join(f"<p>{e(w)}</p>" for w in rejected_lines(summary))}
<h2>Incidents</h2>
{"<p>None.</p>" if not inc else ""}
{"<table><tr><th>#</th><th>min</th><th>kind</th><th>where</th><th>steps</th><th>lost</th><th>what</th><th>what to do</th></tr>" + inc + "</table>" if inc else ""}
{"<details><summary>Live alerts (" + str(len(summary["alerts"])) + ")</summary><table><tr><th>min</th><th>step</th><th>where</th><th>alert</th><th>diagnosis</th><th>what</th></tr>" + alerts + "</table></details>" if alerts else ""}
{"<h2>Timeline per node</h2>" + tl if (tl := img("timeline")) else ""}
{restarts_html(summary)}
{recoveries_html(summary)}
{restores_html(summary)}
{ranks_html(summary, img)}
<h2>Throughput</h2>{img("throughput")}
<h2>Data wait and checkpoint blocking</h2>{img("waits")}
<details><summary>Config (newest attempt; credentials redacted)</summary>
<pre>{e(json.dumps(summary.get("config"), indent=1, default=str))}</pre></details>
<p><small>Definitions: docs/monitoring.md (buckets of Google's ml-goodput-measurement).
</small></p></body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def build_report(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    plots: bool = True,
) -> dict[str, Any]:
    """Write the plots, the HTML page and report.json; return the summary dict. ``plots``
    False: no PNG (matplotlib is most of a small run's report: ~1.6 s of its ~1.7 s of CPU
    here), each named in ``plots_missing`` as not asked for; the numbers are the same."""
    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    rejects = Rejects()
    fold = _read(run, rejects)
    next(fold)  # a missing ledger fails here, before anything is read
    records = load(run, rejects, visit=fold.send)  # every record, read and warned about once
    try:
        fold.send(None)
        raise AssertionError("the ledger fold did not end")  # pragma: no cover
    except StopIteration as done:
        data = done.value
    t0 = data["t0"]
    section = data["ranks"] = rank_section(records.view)
    # The incidents: the diagnosis engine's, from the same records (diagnose/); the plots
    # mark these, numbered as in the table.
    incidents = diagnose(records)
    # The one computation every view prints (heading, table, plots, JSON); a slow rank's
    # compute is charged as the engine measured it.
    ledger = data["ledger_breakdown"]
    b = data["breakdown"] = breakdown(ledger, section["view"], data["records_lost"], incidents)
    s = data["series"]
    step_t = dict(zip(s.step, s.t, strict=True))  # a redone step: its newest attempt's time
    data["alerts"] = attach_ranks(data["alerts"], section["stragglers"], section["ranks"], step_t)
    data["incidents"] = incident_rows(incidents, t0)
    # every restart phase by phase (report/restarts.py), and on the incident that caused it
    restarts = restart_rows(records)
    after = {r["after"]: r for r in restarts}
    for row in data["incidents"]:
        if row.get("attempt") in after:
            row["restart"] = {k: after[row["attempt"]][k] for k in ("attempt", "wall_s", "phases")}
    summary = b.to_dict()
    summary.pop("attempt_summaries")
    summary.update(
        {
            "run_dir": str(run),
            # finished / stopped (by failures or a signal) / still running as of the last
            # record, at step N of M: the first line of every view (diagnose/job_state.py)
            "job_state": job_state(records),
            "attempts_detail": b.attempt_summaries,
            # per attempt: its start-up phases, restore and first step's excess; per restart:
            # last progress -> next first step, in phases (report/restarts.py)
            "attempt_phases": attempt_rows(records),
            "restart_phases": restarts,
            # each in-place recovery or its fallback: path, reason, phases (report/recoveries.py)
            "recoveries": recovery_rows(records.events),
            "expected_tokens_per_s": data["band"],
            # per attempt: {"band": [low, high or null], "kind": "expected" | "learned"} or
            # null, as the throughput plot shades it
            "bands_per_attempt": data["bands"],
            "device": data["device"],
            "crashes": data["crashes"],
            "config": data["starts"][-1].get("config"),  # the newest attempt's, redacted below
            # one row per rank (monitor/ranks.py), and what could not be read: never fatal
            "ranks": section["ranks"],
            "missing_ranks": section["missing_ranks"],
            "torn_lines": section["torn_lines"],
            # records and files skipped as invalid, by file (relative to RUN_DIR) and
            # reason: {"ledger.jsonl": {"count": N, "reasons": {reason: n}}} (records.py)
            "rejected_records": rejects.to_dict(),
            # spans of records a failing run-directory disk made the writers drop
            # (monitor/records_lost.py): [{"file", "first_step", "last_step", "count", ...}]
            "records_lost": data["records_lost"],
            # one row per attempt that restored a step > 0: attempt, step, tier
            # (local-memory, peer-memory, durable), seconds, steps_lost; and the memory
            # tier's snapshots, whose blocking is inside checkpoint_block (report/restores.py)
            "restores": data["restores"].rows(),
            "restores_by_tier": data["restores"].by_tier(),
            # what each restore passed over and why: another run's or another user's
            # snapshots, damaged copies on any node, partial or foreign checkpoints
            "restores_passed_over": data["restores"].passed_over()[0],
            "restores_passed_over_more": data["restores"].passed_over()[1],
            "memory_snapshots": data["restores"].snapshots(b.badput_s["checkpoint_block"]),
            # one per fault (diagnose.Incident.to_dict() plus compatibility keys: step,
            # node, rank, diagnosis, next, minutes): docs/monitoring.md "Incidents"
            "incidents": data["incidents"],
            # what the live checks wrote into the ledger as the run went (alert records)
            "alerts": [
                {
                    "minutes": None if a.get("t") is None else (a["t"] - t0) / 60,
                    **{k: a.get(k) for k in INCIDENT_KEYS},
                }
                for a in data["alerts"]
            ],
        }
    )
    # Nothing shown may hold a credential: an older ledger's config, a URL in a message.
    summary["data_bound"] = data_bound(summary)
    summary = redact(summary)
    # What each plot drew (the goodput bar's shares, the heatmap's row labels), so a test or
    # a reader can check a PNG against the table without reading pixels.
    summary["plotted"] = {}
    # A plot that cannot be drawn is named here with why; the rest of the report still is.
    summary["plots_missing"] = {}
    if plots:
        summary["plots"] = _plots(data, out, summary["plotted"], summary["plots_missing"])
    else:
        summary["plots"] = {}
        summary["plots_missing"] = dict.fromkeys(PLOT_NAMES, "not asked for (--no-plots)")
    summary["html"] = str(_html(summary, out))
    summary["json"] = str(out / "report.json")
    # Atomic, so a reader never parses half a report; not fsync'd: rerunning
    # ``steadytrain report`` rebuilds it from the ledger.
    publish_bytes(
        str(out / "report.json"), json.dumps(summary, indent=2, default=str), durable=False
    )
    return summary
