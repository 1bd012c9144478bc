"""CPU cost of the read-only commands (issue 27: "listing checkpoints under 1 s of CPU").

`checkpoints`, `inspect`, `verify` and `report` read files and hash them; none needs a
tensor. Before issue 27 `checkpoints` imported torch through the checkpoint package and
paid ~2 s of CPU for it. This bench measures each command's whole process (interpreter
start to exit: user + system CPU of the child, from ``getrusage(RUSAGE_CHILDREN)``) side by
side with the baseline "the same command with torch imported first", which is what it cost
when the import chain pulled torch in. Contenders are interleaved, ``--reps`` rounds; the
JSON has every sample and the table reports median and min-max.

    python bench/readonly_cli.py [--reps 7] [--out bench/results/readonly_cli.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SETUP = r"""
import os, sys, numpy as np, torch
from steadytrain import Checkpointer, GoodputMeter
from steadytrain.data.ingest.writer import DatasetWriter
root = sys.argv[1]
rng = np.random.default_rng(0)
with DatasetWriter(f"{root}/ds", vocab_size=5000, eos_id=0, tokenizer={"type": "test"},
                   shard_tokens=1_000_000) as w:
    lengths = rng.integers(200, 4000, size=2000)
    tokens = rng.integers(1, 5000, size=int(lengths.sum()))
    tokens[np.cumsum(lengths) - 1] = 0
    w.add_documents(tokens, lengths)
model = torch.nn.Linear(512, 512)
optim = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 512)).sum().backward(); optim.step()
ckpt = Checkpointer(f"{root}/ckpts", every_steps=1, keep_last=3, async_mode="sync")
for step in (1, 2, 3):
    ckpt.save(step, {"model": model, "optim": optim})
ckpt.close()
meter = GoodputMeter(f"{root}/run", sinks=("jsonl",))
meter.job_start(restored_step=0)
import time
for step in range(1, 201):  # steps that take the time they claim
    time.sleep(0.011)
    meter.step(step, tokens=4096, data_wait_s=0.001, compute_s=0.01)
meter.close()
"""

COMMANDS = {
    "checkpoints": ["checkpoints", "{root}/ckpts", "--json"],
    "inspect": ["inspect", "{root}/ds", "--json"],
    "verify": ["verify", "{root}/ds", "--json"],
    "report": ["report", "{root}/run", "--json", "--out", "{root}/report"],
}


def child_cpu(argv: list[str]) -> tuple[float, int]:
    """User + system CPU seconds of one child process, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0,):
        raise SystemExit(f"{argv}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return cpu, proc.returncode


def contenders(args: list[str]) -> dict[str, list[str]]:
    code = "import sys; from steadytrain.cli import main; sys.exit(main(sys.argv[1:]))"
    return {
        "steadytrain": [sys.executable, "-c", code, *args],
        "with torch imported (before)": [sys.executable, "-c", "import torch; " + code, *args],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--out", default=os.path.join("bench", "results", "readonly_cli.json"))
    a = p.parse_args()
    if a.reps < 1:
        p.error("--reps must be at least 1")
    with tempfile.TemporaryDirectory(prefix="readonly-bench-") as root:
        subprocess.run([sys.executable, "-c", SETUP, root], check=True)
        samples: dict[str, dict[str, list[float]]] = {}
        for rep in range(a.reps):
            for cmd, template in COMMANDS.items():
                args = [x.format(root=root) for x in template]
                order = list(contenders(args).items())
                if rep % 2:
                    order.reverse()  # alternate which contender runs first
                for name, argv in order:
                    cpu, _ = child_cpu(argv)
                    samples.setdefault(cmd, {}).setdefault(name, []).append(cpu)
    rows = {}
    for cmd, by in samples.items():
        ours, base = by["steadytrain"], by["with torch imported (before)"]
        rows[cmd] = {
            name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for name, v in by.items()
        }
        rows[cmd]["ratio_of_medians"] = statistics.median(base) / statistics.median(ours)
    doc = {
        "benchmark": "readonly_cli",
        "command": f"python bench/readonly_cli.py --reps {a.reps}",
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": list(os.getloadavg()),
        "target": "checkpoints: under 1 s of CPU (whole process)",
        "samples_cpu_s": samples,
        "summary": rows,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("| command | steadytrain CPU s (median, min-max) | torch imported first | ratio |")
    print("|---|---|---|---|")
    for cmd, r in rows.items():
        o, b = r["steadytrain"], r["with torch imported (before)"]
        print(
            f"| `{cmd}` | {o['median']:.2f} ({o['min']:.2f}-{o['max']:.2f}) | "
            f"{b['median']:.2f} ({b['min']:.2f}-{b['max']:.2f}) | {r['ratio_of_medians']:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
