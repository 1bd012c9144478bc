"""`steadytrain report RUN_DIR [--out DIR] [--json]`: goodput, incidents, plots."""

from __future__ import annotations

import argparse

HELP = "goodput breakdown, incidents with diagnoses, and plots of a run"
DESCRIPTION = (
    "Read RUN_DIR/ledger.jsonl (every attempt of the run) and every rank's file under "
    "RUN_DIR/ranks/, and write throughput, wait, goodput and per-rank heatmap plots (PNG), "
    "one HTML page and report.json; incidents name the rank and node, stragglers included."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding ledger.jsonl")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.monitor.records_lost import lost_warning
    from steadytrain.monitor.report import build_report, rejected_lines, slowdown_note
    from steadytrain.monitor.report_ranks import who

    s = build_report(args.run_dir, args.out)
    if args.json:
        print_json(s)
        return 0
    print(f"goodput {s['goodput']:.1%} of {s['total_s'] / 60:.1f} min, {s['attempts']} attempt(s)")
    for line in lost_warning(s.get("records_lost") or []):  # a failing disk's gaps
        print(f"  {line}")
    for k, v in s["badput"].items():
        if v > 0:
            print(f"  {k:<18} {v:6.1%}  ({s['badput_s'][k]:.1f} s)")
    if note := slowdown_note(s):
        print(f"  {note}")
    for i, a in enumerate(s["incidents"], 1):
        where = f" on {who(a)}" if who(a) else ""
        print(
            f"incident {i} at step {a['step']}{where}: {a['kind']} -> {a['diagnosis']}: "
            f"{a['message']}"
        )
    if s["ranks"]:
        worst = max(s["ranks"], key=lambda r: r["data_wait_share"])
        print(
            f"ranks: {len(s['ranks'])} on {len({r['node'] for r in s['ranks']})} node(s); "
            f"most data wait: rank {worst['rank']} ({worst['node']}) "
            f"{worst['data_wait_share']:.1%} of its step time"
        )
    for m in s["missing_ranks"]:
        print(f"missing: rank {m['rank']} of attempt {m['attempt']} ({m['reason']})")
    if s["torn_lines"]:
        print(f"rank files: {s['torn_lines']} torn line(s) skipped (a rank killed mid-write)")
    for line in rejected_lines(s):  # records skipped as invalid (monitor/records.py)
        print(line)
    print(f"report: {s['html']}")
    return 0
