"""Experiment: why a DDP run restarted mid-way differs from an uninterrupted one at 3+ ranks.

For each world size, the ranks (gloo, CPU, one thread each) run
``tests/distributed/ddp_resume_worker.py``: the reference GPT (4 layers, d=128: four 1 MB
gradient buckets), 6 steps of 2 micro-batches, once uninterrupted and once restarted after
step 3 from a copy of its state, in three variants:

- ``stock``: DDP as it comes;
- ``replay``: stock, but the restarted DDP starts in the bucket layout the first run had
  rebuilt after its first step: if the layout is the cause, this one is exact;
- ``exact``: ``steadytrain.exact_ddp``.

It prints, per variant, how many of the parameter tensors differ from the uninterrupted
run after each step that followed the restart, the layout DDP rebuilt, whether the
uninterrupted runs with and without ``exact_ddp`` end with the same weights (at 2 ranks they
must: its arithmetic is DDP's own; at 3+ they differ from step 1 on, which ``exact_ddp``
reduces in the rebuilt layout), and the median step time of the uninterrupted run (2 shared cores: read the times as a rough indication, not a
measurement of the hook's cost on a GPU).

    .venv/bin/python bench/ddp_resume_layout.py [--worlds 2 3 4]

Writes bench/results/ddp_resume_layout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "tests", "distributed", "ddp_resume_worker.py")
sys.path.insert(0, HERE)

from _spawn import spawn_ranks  # noqa: E402


def run(world: int, variants: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = ["--init", os.path.join(tmp, "init"), "--out", out, "--variants", *variants]
        procs = spawn_ranks(WORKER, world, args)  # each rank's RANK and WORLD_SIZE
        codes = [p.wait(timeout=600) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"ranks exited {codes}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--variants", nargs="+", default=["stock", "replay", "exact"])
    a = p.parse_args()
    results = []
    for world in a.worlds:
        got = run(world, a.variants)
        results.append(got)
        print(f"{world} ranks, restart after step {got['restart_at']} of {got['steps']}:")
        for v in a.variants:
            r = got[v]
            print(
                f"  {v:7s} tensors differing after each later step "
                f"{r['differing_after_restart']} of {r['tensors']}; "
                f"median step {r['median_step_s'] * 1e3:.1f} ms; warnings {r['warnings']}"
            )
        print(f"  rebuilt layout (parameter indices per bucket): {got['stock']['rebuilt_layout']}")
        if "stock" in got and "exact" in got:
            same = got["stock"]["uninterrupted_sha256"] == got["exact"]["uninterrupted_sha256"]
            print(f"  uninterrupted runs, exact_ddp and stock: {'equal' if same else 'differ'}")
    path = os.path.join(HERE, "results", "ddp_resume_layout.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
