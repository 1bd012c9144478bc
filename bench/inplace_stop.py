"""Stop -> next productive step: a SIGSTOPped rank, decided hung and recovered in place.

    python bench/inplace_stop.py [--faults 5] [--floor-s 2] [--ranks 2]
        [--out bench/results/inplace_stop.json]

The job of ``bench/inplace_recovery.py`` (``bench/_inplace_worker.py``, a small DDP MLP,
gloo, CPU) under the keeper, each rank with the hang watchdog on and in-place recovery on
(``HangWatchdog(in_place=True)``, deadline ``max(8 x p99 step, --floor-s)``, poll 0.25 s).
``--faults`` times: wait until rank 1's current process completed 20 steps, SIGSTOP it,
and time until the rank's next process completed its first step. The chain in between:
the other ranks' watchdogs pass their deadline while they wait in DDP's all-reduce, publish
their verdicts ("waiting"); rank 1's reaper sees its parent stopped and says so
(``stopped-rank-1.json``), so they decide at once that rank 1 is the hung one (no grace
spent waiting for a verdict that cannot come); the reaper SIGKILLs it; the keeper forks a
replacement; the survivors' all-reduce raises (the dead peer's socket closed), their
watchdogs do not exit (the decision does not name them), and ``Recovery`` regroups.

Per fault: the gap, the deadline in force (from the survivor's verdict), the gap minus the
deadline (issue 44's target: at most 2 s), the decision's culprits, and whether every
survivor kept its process. Median and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from inplace_recovery import WORKER, _pid, _records, _wait, summary

HERE = os.path.dirname(os.path.abspath(__file__))


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _after(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def measure(faults: int, floor_s: float, ranks: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix="inplace-stop-")
    env = dict(os.environ, OMP_NUM_THREADS="1", STEADYTRAIN_INPLACE_MAX=str(faults + 1))
    env.update(STEADYTRAIN_BENCH_FLOOR_S=str(floor_s), STEADYTRAIN_BENCH_NONCE=os.urandom(8).hex())
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the keeper needs the shared store
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    cmd += ["--max-restarts=0", "--monitor-interval=0.1"]
    cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    cmd += ["-m", "steadytrain.inplace.keeper", WORKER, out, "watchdog"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        for generation in range(faults):
            pid = int(_wait(lambda: _pid(out)))
            _wait(lambda pid=pid: sum(r["pid"] == pid for r in _records(out, 1)) >= 20)
            t_stop = time.time()
            os.kill(pid, signal.SIGSTOP)
            first = _wait(
                lambda pid=pid, t=t_stop: next(
                    (r for r in _records(out, 1) if r["pid"] != pid and r["t"] > t), None
                )
            )
            hangs = os.path.join(out, "run", "hangs", f"attempt-{generation}")
            verdict = _json(os.path.join(hangs, "rank-0.json")) or {}
            decision = _json(os.path.join(hangs, "decision-0.json")) or {}
            reaped = _json(os.path.join(hangs, "reaped-rank-1.json")) or {}
            gap = first["t"] - t_stop
            rows.append(
                {
                    "gap_s": round(gap, 3),
                    "deadline_s": round(verdict.get("deadline_s", float("nan")), 3),
                    "over_deadline_s": round(gap - verdict.get("deadline_s", float("nan")), 3),
                    # when each link of the chain happened, seconds after the stop
                    "detected_s": _after(verdict.get("detect_t"), t_stop),
                    "decided_s": _after(decision.get("t"), t_stop),
                    "killed_s": _after(reaped.get("t"), t_stop),
                    # the kill -> the job's next productive step: the SIGKILL path's share
                    "after_kill_s": _after(first["t"], reaped["t"]) if reaped else None,
                    # the kill -> the replacement running the script (its pid file written)
                    "replaced_s": _after(os.path.getmtime(os.path.join(out, "pid-r1")), reaped["t"])
                    if reaped
                    else None,
                    "stuck_ranks": decision.get("stuck_ranks"),
                    "cause": decision.get("cause"),
                    "reaped": reaped.get("reason"),
                    "noted_stopped": os.path.exists(os.path.join(hangs, "stopped-rank-1.json")),
                }
            )
        survivors = {r: {x["pid"] for x in _records(out, r)} for r in range(ranks) if r != 1}
        for row in rows:
            row["survivors_kept_their_process"] = all(len(p) == 1 for p in survivors.values())
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--floor-s", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "inplace_stop.json"))
    args = ap.parse_args()
    rows = measure(args.faults, args.floor_s, args.ranks)
    over = [r["over_deadline_s"] for r in rows]
    result = {
        "faults": args.faults,
        "ranks": args.ranks,
        "floor_s": args.floor_s,
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "gap": summary([r["gap_s"] for r in rows]),
        "deadline_s": summary([r["deadline_s"] for r in rows]),
        "over_deadline": summary(over),
        "after_kill": summary([r["after_kill_s"] for r in rows if r["after_kill_s"] is not None]),
        "target_met": max(over) <= 2.0,
        "each": rows,
    }
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
