"""``steadytrain demo [--json]``: the whole story on embedded defaults."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "run the demo on the embedded corpus (the Python standard library's source)"
DESCRIPTION = (
    "Tokenize the Python standard library's source into RUN_DIR/data, train "
    "the small GPT with 2 processes under torchrun on CPU with asynchronous checkpoints, "
    "inject two crashes (mid-step and mid-save), resume automatically, then print the "
    "goodput report and the planner's recommended checkpoint interval. About a minute "
    "on 2 cores. With --incident NAME, replay one incident instead on K nodes on this "
    "machine (network namespaces as root, else loopback addresses), with and without its "
    "fix; about 1-2 minutes each."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<timestamp>")
    p.add_argument("--tokenizer", default="bytes", help="bytes | PATH.json | train:VOCAB")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument(
        "--corpus-bytes", type=int, default=None, help="use only this much of the corpus"
    )
    p.add_argument("--no-train", action="store_true", help="stop after tokenizing")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    from steadytrain.testing.incidents import INCIDENTS

    p.add_argument(
        "--incident",
        choices=list(INCIDENTS),
        metavar="NAME",
        help="replay an incident instead, with and without its fix: "
        + "; ".join(f"{k}: {v[1]}" for k, v in INCIDENTS.items()),
    )


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.demo import run_demo

    def warn(msg: str) -> None:
        print(f"steadytrain demo: warning: {msg}", file=sys.stderr)

    def out(line: str) -> None:
        # Under --json, stdout carries only the JSON object: progress goes to stderr.
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    if args.incident:
        return _incident(args, out)
    summary = run_demo(
        args.run_dir,
        tokenizer=args.tokenizer,
        workers=args.workers,
        corpus_limit_bytes=args.corpus_bytes,
        steps=args.steps,
        train=not args.no_train,
        quiet=args.quiet or args.json,
        out=None if args.quiet else out,
        warn=warn,
    )
    if args.json:
        print_json(summary)
        return 0
    print(
        f"done: {summary['steps']} steps, {summary['restarts']} restarts, goodput "
        + (f"{100 * summary['goodput']:.1f} %" if summary["goodput"] is not None else "n/a")
        + f"; run dir {summary['run_dir']}"
    )
    return 0


def _incident(args: argparse.Namespace, out) -> int:  # noqa: ANN001
    import json
    import os

    from steadytrain.demo import default_run_dir
    from steadytrain.printable import printable
    from steadytrain.testing.incidents import replay

    workdir = args.run_dir or default_run_dir().replace("demo-", f"incident-{args.incident}-")
    os.makedirs(workdir, exist_ok=True)
    result = replay(
        args.incident, os.path.abspath(workdir), log=lambda m: None if args.quiet else out(m)
    )
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    gp = result.get("goodput", {})

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    print(
        f"incident {args.incident} ({result.get('mode')}): goodput without the fix "
        f"{pct(gp.get('without_fix'))}, with it {pct(gp.get('with_fix'))}; "
        f"{result.get('seconds', 0):.0f} s"
    )
    checks = result.get("checks", {})
    for run in [*result.get("runs", {}), *(r for r in checks if r not in result.get("runs", {}))]:
        found = [i for i in result.get("incidents", []) if i.get("run") == run]
        print(f"  [{run}] the report's incidents: " + ("none" if not found else ""))
        for i in found:
            for line in incident_lines(i):
                print(f"    {printable(line)}")  # node names come from the run's records
        check = checks.get(run)
        if check is not None:
            print(f"    injected vs diagnosed: {_verdict(check)}")
    lv = result.get("loss_variance")
    if lv:
        print(
            f"  step-to-step loss variance: sequential {lv['sequential']:.4f}, global "
            f"{lv['global']:.4f}, ratio {lv['ratio']:.1f}"
        )
    for key, label, unit, scale in (
        ("detect_s", "hang detected after", "s", 1.0),
        ("shm_growth_bytes", "/dev/shm growth", "MiB", 1 / 2**20),
        ("train_s", "time for the same steps", "s", 1.0),
    ):
        if isinstance(result.get(key), dict):
            parts = [
                f"{run} {'n/a' if v is None else f'{v * scale:.1f} {unit}'}"
                for run, v in result[key].items()
            ]
            print(f"  {label}: " + ", ".join(parts))
    for run, r in result.get("runs", {}).items():
        for x in r.get("restores") or []:  # the report's restores (node-loss)
            print(
                f"  [{run}] restart {x.get('attempt')}: restored step {x.get('step')} from "
                f"{x.get('tier')} in {x.get('seconds') or 0:.2f} s, "
                f"{x.get('steps_lost')} step(s) lost"
            )
    for run, r in result.get("runs", {}).items():
        print(f"  {run}: {r.get('report_html')}")
    return 0


def incident_lines(i: dict[str, Any]) -> list[str]:
    """One report incident (``steadytrain report --json``) as the demo prints it: kind,
    where, steps, what it cost, then the advice."""
    nodes = ", ".join(i.get("nodes") or []) or "-"
    ranks = ", ".join(str(r) for r in i.get("ranks") or []) or "-"
    first, last = i.get("first_step"), i.get("last_step")
    steps = "?" if first is None else (f"{first}" if last in (None, first) else f"{first}-{last}")
    lost = i.get("lost_s")
    head = f"{i.get('kind')} on node(s) {nodes} (rank(s) {ranks}), step(s) {steps}" + (
        "" if lost is None else f", lost {lost:.1f} s"
    )
    out = [head]
    if i.get("message"):
        out.append(f"  {i['message']}")
    if i.get("advice"):
        out.append(f"  advice: {i['advice']}")
    return out


def _verdict(check: dict[str, Any]) -> str:
    """A replay's check of one run (steadytrain.testing.incidents.expect.check)."""
    parts = [f"found {e['kind']} on {', '.join(e['nodes']) or 'the job'}"
             for e, _ in check.get("matched", [])]  # fmt: skip
    parts += [f"MISSED {m['expected']['kind']} on {', '.join(m['expected']['nodes']) or 'the job'}"
              for m in check.get("missed", [])]  # fmt: skip
    parts += [f"FALSE ALARM {i.get('kind')}" for i in check.get("extra", [])]
    return "; ".join(parts) or "clean, as injected"
