"""Benchmark: how long the scheduler's noise lasts against a throttled rank (issue 42, 1).

The diagnosis names a rank whose forward pass stays above the healthy ranks' level; on a
loaded machine every rank's host is as loaded and the scheduler slows whichever rank it
leaves out. This measures both, on the diagnosis matrix's tiny job (24 steps, one rank per
process, a local dataset of small shards) under ``torchrun --standalone`` on this machine:

- ``--clean N`` clean runs (alternating 2 and 3 ranks): per 5-step window (after the
  warm-up), each rank's forward time over the healthy level (``healthy_ref``), and the
  longest streak of windows at or above the unspecific factor (``compute_factor`` where
  every host is as loaded: 3x);
- ``--throttled K`` runs of 2 ranks where rank 1 (its processes) is moved into a cgroup
  with a CPU quota of ``--quota`` cores once step 4 is traced (``testing.cgroups``; root
  and cgroup v1), the matrix's CPU-quota straggler without the node harness;
- for every run the report's incidents (``steadytrain.diagnose``): none may come from a
  clean run, the throttled rank must be named.

    .venv/bin/python bench/straggler_noise.py --clean 12 --throttled 3 --quota 0.1

Writes bench/results/straggler_noise.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

from steadytrain.diagnose import stragglers as S
from steadytrain.diagnose.engine import diagnose
from steadytrain.diagnose.inputs import load
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.windows import UNSPECIFIC_FACTOR, host_state
from steadytrain.testing.cgroups import NodeQuota
from steadytrain.testing.incidents.common import (
    TINY_SETTINGS,
    read_trace,
    small_shards,
    train_args,
)

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, FAULT_AT = 24, 4


def _rank_pids(rank: int, run_id: str) -> list[int]:
    """The processes of torchrun worker ``rank`` of this run (its environment says so)."""
    want = {f"RANK={rank}".encode(), f"STRAGGLER_NOISE_RUN={run_id}".encode()}
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = set(f.read().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                out.append(int(entry))
    return out


def run_job(run_dir: str, dataset: str, nproc: int, quota: float | None) -> None:
    """The tiny job; with ``quota``, rank 1 held to that many cores from step FAULT_AT."""
    settings = [*TINY_SETTINGS, f"run_dir={run_dir}", f"data.dataset={dataset}",
                "data.shuffle=global", "data.prefetch_steps=0", "data.prefetch=0",
                f"data.global_batch={4 * nproc}", f"train.max_steps={STEPS}",
                "monitor.straggler_every_s=0.5", "checkpoint.every_steps=1000"]  # fmt: skip
    run_id = secrets.token_hex(4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "STRAGGLER_NOISE_RUN": run_id}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *train_args(settings)]  # fmt: skip
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        q = None
        try:
            if quota:
                while (
                    proc.poll() is None
                    and max((r["step"] for r in read_trace(run_dir)), default=0) < FAULT_AT
                ):
                    time.sleep(0.05)
                q = NodeQuota(run_id, "rank-1")
                q.set(quota)
                q.add(_rank_pids(1, run_id))
            if proc.wait(timeout=900) != 0:
                raise RuntimeError(f"{run_dir}: torchrun exited {proc.returncode}")
        finally:
            if proc.poll() is None:
                proc.kill()
            if q is not None:
                q.remove()


def windows(run_dir: str) -> dict[str, Any]:
    """Per rank and window: forward time over the healthy level, and the throttled share."""
    rec = load(run_dir)
    _, grid, _, wins = S.windows_of(rec.view, S.alert_config(rec.starts))
    out: dict[str, Any] = {}
    for r in sorted(grid):
        ratios, thr = [], []
        for row in wins:
            ref = S.healthy_ref(S._value(w, "compute") for w in row.values())
            w = row.get(r)
            v = None if w is None else S._value(w, "compute")
            ratios.append(None if v is None or not ref else round(v / ref, 2))
            thr.append(None if w is None else host_state(w)[1].get("throttled_share"))
        out[str(r)] = {"ratio": ratios, "throttled_share": thr}
    return out


def streak(ratios: list[float | None], at: float) -> int:
    best = cur = 0
    for x in ratios:
        cur = cur + 1 if x is not None and x >= at else 0
        best = max(best, cur)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clean", type=int, default=12)
    p.add_argument("--throttled", type=int, default=3)
    p.add_argument("--quota", type=float, default=0.1, help="cores of the throttled rank")
    p.add_argument("--out", default=os.path.join(HERE, "results", "straggler_noise.json"))
    args = p.parse_args()
    factor = UNSPECIFIC_FACTOR * AlertConfig().straggler_compute_factor
    work = tempfile.mkdtemp(prefix="straggler-noise-")
    dataset = small_shards(os.path.join(work, "ds"))
    jobs = [("clean", 2 + i % 2, None) for i in range(args.clean)]
    jobs += [("throttled", 2, args.quota) for _ in range(args.throttled)]
    rows = []
    for i, (kind, nproc, quota) in enumerate(jobs):
        run_dir = os.path.join(work, f"{i:02d}-{kind}")
        t0 = time.monotonic()
        run_job(run_dir, dataset, nproc, quota)
        per_rank = windows(run_dir)
        incidents = [{"kind": x.kind, "ranks": x.ranks, "first_step": x.first_step,
                      "last_step": x.last_step, "lost_s": round(x.lost_s, 2)}
                     for x in diagnose(run_dir)]  # fmt: skip
        rows.append({"run": kind, "ranks": nproc, "quota": quota, "windows": per_rank,
                     "longest_streak_at_factor": max(streak(v["ratio"], factor)
                                                     for v in per_rank.values()),
                     "max_ratio": max((x for v in per_rank.values() for x in v["ratio"]
                                       if x is not None), default=None),
                     "incidents": incidents, "seconds": round(time.monotonic() - t0, 1)})  # fmt: skip
        r = rows[-1]
        print(
            f"  {kind:9s} {nproc} ranks: max {r['max_ratio']}x, longest streak at "
            f"{factor:.0f}x: {r['longest_streak_at_factor']} window(s), incidents "
            f"{[(x['kind'], x['ranks']) for x in incidents]}",
            flush=True,
        )
    clean = [r for r in rows if r["run"] == "clean"]
    slow = [r for r in rows if r["run"] == "throttled"]
    result = {
        "command": f"python bench/straggler_noise.py --clean {args.clean} --throttled "
        f"{args.throttled} --quota {args.quota}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
        "unspecific_factor": factor,
        "clean": {
            "runs": len(clean),
            "with_incident": sum(1 for r in clean if r["incidents"]),
            "longest_streak_at_factor": max(
                (r["longest_streak_at_factor"] for r in clean), default=0
            ),  # fmt: skip
            "max_ratio": max((r["max_ratio"] or 0 for r in clean), default=None),
        },
        "throttled": {
            "runs": len(slow),
            "named": sum(1 for r in slow if any(x["ranks"] == [1] for x in r["incidents"])),
            "min_ratio_rank_1": min(
                (x for r in slow for x in r["windows"]["1"]["ratio"] if x is not None), default=None
            ),  # fmt: skip
        },
        "runs": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("clean", "throttled")}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
