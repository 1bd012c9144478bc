"""`steadytrain report RUN_DIR [--out DIR] [--json] [--no-plots]`: goodput, incidents,
plots."""

from __future__ import annotations

import argparse

HELP = "goodput breakdown, incidents with diagnoses, and plots of a run"
DESCRIPTION = (
    "Read RUN_DIR/ledger.jsonl (every attempt of the run) and every rank's file under "
    "RUN_DIR/ranks/, and write throughput, wait, goodput and per-rank heatmap plots (PNG), "
    "one HTML page and report.json; incidents name the rank and node, stragglers included."
)


_RANK_LINES = 32  # (rank, node) lines printed; a 1000-rank job's others are in the HTML


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding ledger.jsonl")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--no-plots",
        action="store_true",
        help="draw no PNG (the page and the numbers stay; most of a report's CPU is plots)",
    )


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.monitor.records_lost import lost_warning
    from steadytrain.printable import printable
    from steadytrain.report.build import (
        bucket_rows,
        build_report,
        capped_lines,
        checkpoint_words,
        rejected_lines,
        slowdown_note,
        state_text,
    )
    from steadytrain.report.ranks import node_rows, where
    from steadytrain.report.recoveries import recovery_lines
    from steadytrain.report.restarts import phase_words, restart_lines
    from steadytrain.report.restores import restore_lines

    def say(line: str) -> None:
        # Node names, messages and paths come from the run's records: no escape code in
        # them reaches the terminal (steadytrain/printable.py).
        print(printable(line))

    s = build_report(args.run_dir, args.out, plots=not args.no_plots)
    if args.json:
        print_json(s)
        return 0
    say(state_text(s))  # finished / stopped / still running, at step N of M
    say(
        f"goodput {s['goodput']:.1%} of {s['total_s'] / 60:.1f} min, {s['attempts']} attempt(s), "
        f"{s['steps_kept']} steps kept, {s['steps_lost']} redone, {checkpoint_words(s)}"
    )
    for line in lost_warning(s.get("records_lost") or []):  # a failing disk's gaps
        say(f"  {line}")
    # The report's one breakdown: every bucket, zero ones too, and their sum.
    for k, sec, share in bucket_rows(s):
        say(f"  {k:<18} {share:6.1%}  ({sec:.1f} s)")
    db = s["data_bound"]
    say(
        f"  data-bound (data_wait + straggler_wait) {db['share']:.1%} ({db['s']:.1f} s): "
        "each step at its slowest rank's data wait"
    )
    if note := slowdown_note(s):
        say(f"  {note}")
    for line in capped_lines(s):  # a charge larger than what it came out of
        say(f"  {line}")
    # The diagnosis engine's incidents (one per fault): kind, where, steps, cost, what, advice.
    if not s["incidents"]:
        say("incidents: none")
    for i, a in enumerate(s["incidents"], 1):
        at = where(a)
        first, last = a.get("first_step"), a.get("last_step")
        steps = (
            ""
            if first is None
            else f" steps {first}" + (f"-{last}" if last not in (None, first) else "")
        )
        say(f"incident {i}: {a['kind']}{' on ' + at if at else ''}{steps}, "
              f"lost {a['lost_s']:.1f} s: {a['message']}")  # fmt: skip
        say(f"  what to do: {a['advice']}")
        if a.get("restart"):  # the restart this incident caused, phase by phase
            r = a["restart"]
            say(f"  its restart: {r['wall_s']:.2f} s: {phase_words(r['phases'])}")
    for line in restart_lines(s):  # each restart, phase by phase
        say(line)
    for line in recovery_lines(s):  # in place or whole restart, and why
        say(line)
    for line in restore_lines(s):  # which tier each restart came back from, snapshot costs
        say(line)
    if s.get("alerts"):
        say(f"live alerts: {len(s['alerts'])} (in the HTML and --json under 'alerts')")
    if s["ranks"]:
        lines = node_rows(s["ranks"])
        nodes = {n for r in s["ranks"] for n in (r.get("nodes") or [r["node"]])}
        worst = max(lines, key=lambda r: r["data_wait_share"])
        say(
            f"ranks: {len(s['ranks'])} on {len(nodes)} node(s); "
            f"most data wait: rank {worst['rank']} ({worst['node']}) "
            f"{worst['data_wait_share']:.1%} of its step time"
        )
        # One line per (rank, node), most data wait first; every one in the HTML and JSON.
        shown = sorted(lines, key=lambda r: -r["data_wait_share"])[:_RANK_LINES]
        for r in shown:
            say(
                f"  rank {r['rank']:<4} {str(r['node']):<16} {r['steps']:>7} steps  "
                f"data wait {r['data_wait_s']:.2f} s ({r['data_wait_share']:.1%})"
            )
        if len(lines) > len(shown):
            say(f"  ... {len(lines) - len(shown)} more rank line(s) in the HTML and --json")
    for m in s["missing_ranks"]:
        say(f"missing: rank {m['rank']} of attempt {m['attempt']} ({m['reason']})")
    if s["torn_lines"]:
        say(f"rank files: {s['torn_lines']} torn line(s) skipped (a rank killed mid-write)")
    for line in rejected_lines(s):  # records skipped as invalid (monitor/records.py)
        say(line)
    for name, why in (s.get("plots_missing") or {}).items():
        say(f"plot not drawn: {name}.png ({why})")
    say(f"report: {s['html']}")
    return 0
