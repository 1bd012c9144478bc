"""Teardown of ranks stuck in a C++ call: with and without Run's SIGTERM watcher (issue 44).

Ranks 0 and 1 of a torchrun job deadlock in ``recv`` (``tests/distributed/sigterm_worker.py
... deadlock``: both inside a C++ call, where Python's SIGTERM handler cannot run), and then:

- ``restart``: a third rank fails; the agent stops the others (SIGTERM, then SIGKILL after
  its grace). Time from the failure (rank 2's own ``rank_end``) to the agent's exit;
- ``agent``: 2 ranks; the agent itself gets SIGTERM (scancel, preemption). Time from that
  signal to the agent's exit.

Each with ``monitor.sigterm_exit_s`` 2 (the watcher, the default) and 0 (off, as before),
and torchrun's ``--shutdown-timeout`` at its default or as given. Which ranks recorded their
end is listed too (a SIGKILLed rank records nothing).

    .venv/bin/python bench/sigterm_teardown.py [--reps 3] [--shutdown-timeout 5]

Writes bench/results/sigterm_teardown.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "tests", "distributed", "sigterm_worker.py")
ENV = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")


def _cmd(nproc: int, run: str, exit_s: float, shutdown_timeout: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1"]
    if shutdown_timeout is not None:
        cmd.append(f"--shutdown-timeout={shutdown_timeout}")
    return cmd + [WORKER, run, str(exit_s), "deadlock"]


def _ends(run: str) -> dict[int, dict[str, Any]]:
    out = {}
    for path in glob.glob(os.path.join(run, "ranks", "rank-*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a torn line of a killed rank
                if r.get("type") == "rank_end":
                    out[int(path[-11:-6])] = {"t": r["t"], "reason": r["reason"][:60]}
    return out


def restart(exit_s: float, shutdown_timeout: int | None) -> dict[str, Any]:
    run = os.path.join(tempfile.mkdtemp(prefix="teardown-"), "run")
    subprocess.run(
        _cmd(3, run, exit_s, shutdown_timeout), env=ENV, capture_output=True, timeout=300
    )
    done = time.time()
    ends = _ends(run)
    failed = ends[2]["t"]
    return {
        "seconds": done - failed,
        "recorded": {r: round(e["t"] - failed, 2) for r, e in sorted(ends.items()) if r != 2},
    }


def agent(exit_s: float, shutdown_timeout: int | None) -> dict[str, Any]:
    run = os.path.join(tempfile.mkdtemp(prefix="teardown-"), "run")
    p = subprocess.Popen(
        _cmd(2, run, exit_s, shutdown_timeout),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    led = os.path.join(run, "ledger.jsonl")
    deadline = time.time() + 180
    while time.time() < deadline:
        if os.path.exists(led):
            with open(led) as f:
                if f.read().count('"type":"step"') >= 4:
                    break
        time.sleep(0.2)
    time.sleep(1.5)  # both ranks inside the recv
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    sent = time.time() - t0
    return {"seconds": sent, "recorded": {r: round(e["t"] - t0, 2) for r, e in _ends(run).items()}}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shutdown-timeout", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "results", "sigterm_teardown.json"))
    args = p.parse_args()
    out: dict[str, Any] = {"load_average_start": os.getloadavg(), "cases": {}}
    st = args.shutdown_timeout
    for name, fn, exit_s, timeout in (
        ("restart, watcher on", restart, 2.0, None),
        ("restart, watcher off", restart, 0.0, None),
        (f"restart, watcher off, --shutdown-timeout {st}", restart, 0.0, st),
        ("agent SIGTERM, watcher on", agent, 2.0, None),
        ("agent SIGTERM, watcher off", agent, 0.0, None),
        (f"agent SIGTERM, watcher off, --shutdown-timeout {st}", agent, 0.0, st),
    ):
        runs = [fn(exit_s, timeout) for _ in range(args.reps)]
        out["cases"][name] = {"seconds": _spread([r["seconds"] for r in runs]), "runs": runs}
        s = out["cases"][name]["seconds"]
        print(f"{name:<48} {s['median']:6.2f} s ({s['min']:.2f}-{s['max']:.2f})", flush=True)
    out["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
