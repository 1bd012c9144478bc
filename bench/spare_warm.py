"""A node loss with a warm spare against today's node-loss restart, on the node harness.

Each trial is one job on a fresh ``NodeHarness`` of 3 nodes (network namespaces where
possible): ``bench/_restart_worker.py`` (DDP on ``steadytrain.Run``, async checkpoints
every 2 steps, no fault of its own) under torchrun on node-0 and node-1 (1 rank each,
``--nnodes 1:2``, c10d rendezvous on the harness's store), node-2 a spare waiting in the
rendezvous' redundancy list. Once the spare waits and a few steps have passed, node-1 is
lost whole (every process SIGKILLed, its memory emptied); node-0's worker fails in its
all-reduce, its agent and the spare's rendezvous again and start the job's next attempt,
which restores from the durable checkpoint.

- ``cold``: torchrun starts ``bench/_restart_worker.py`` itself (today);
- ``warm``: every node runs ``python -m steadytrain.warm`` for the script, started before
  its agent (on the spare: when it is provisioned), and torchrun's entry point is ``-m
  steadytrain.warm.enter``: each worker, the spare's included, is forked already imported.

Per trial: the time from the kill (this process's clock, just before ``NodeHarness.kill``;
one machine, one clock) to the next attempt's first step record, and the report's phases of
that restart. Trials alternate cold and warm (interleaved, the order flipped every pair,
so load drifts hit both alike); median, min and max per mode over ``--faults`` trials each.

    flock /tmp/steadytrain-nodes.lock .venv/bin/python bench/spare_warm.py [--faults 5]

Writes bench/results/spare_warm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_restart_worker.py")
RDZV = "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=4"
KILL_AFTER_STEPS = 4  # steps after the spare waits (a checkpoint has committed by then)


def _until(pred, what: str, procs: list, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise SystemExit(f"a process exited {p.returncode} while waiting: {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _records(run_dir: str) -> list[dict[str, Any]]:
    from steadytrain.monitor.ledger import read_ledger

    path = os.path.join(run_dir, "ledger.jsonl")
    return read_ledger(path) if os.path.exists(path) else []


def _steps(records: list[dict[str, Any]]) -> tuple[int, int]:
    """(the newest attempt, the newest step of any attempt)."""
    attempt, step = -1, 0
    for r in records:
        if r["type"] == "job_start":
            attempt = max(attempt, r["attempt"])
        elif r["type"] == "step":
            step = max(step, r["step"])
    return attempt, step


def _is_spare(store: Any, run_id: str, agent_pid: int) -> bool:
    """Whether torchrun agent ``agent_pid`` waits in the rendezvous' redundancy list (as
    tests/e2e/train/test_train_spare_node.py reads it: torch's private state)."""
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    got = C10dRendezvousBackend(store, run_id).get_state()
    if got is None:
        return False
    return any(n.pid == agent_pid for n in pickle.loads(got[0]).redundancy_list)


def trial(mode: str, root: str, steps: int = 400) -> dict[str, Any]:
    """One job, one node lost; kill -> next productive step and that restart's phases."""
    from steadytrain.report.build import build_report
    from steadytrain.testing.nodes import NodeHarness

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    run_dir = os.path.join(root, "run")
    run_id = f"spare-{mode}"
    worker = [WORKER, "--run-dir", run_dir, "--faults", "0", "--steps", str(steps)]
    with NodeHarness(os.path.join(root, "h"), nodes=3, log=lambda _m: None) as h:
        env: dict[str, dict[str, str]] = {n.name: {"OMP_NUM_THREADS": "1"} for n in h.nodes}
        servers = []
        if mode == "warm":  # each node's warm process, ahead of its agent
            for n in h.nodes:
                sock = os.path.join(n.cache_dir, "warm", "warm.sock")
                env[n.name]["STEADYTRAIN_WARM_SOCKET"] = sock
                log = os.path.join(root, f"warm-{n.name}.log")
                argv = [sys.executable, "-m", "steadytrain.warm", "--socket", sock, WORKER]
                servers.append((h.popen(n, argv, log_path=log, env=env[n.name]), sock))
            _until(lambda: all(os.path.exists(s) for _, s in servers), "the warm processes",
                   [p for p, _ in servers])  # fmt: skip
        entry = ["-m", "steadytrain.warm.enter"] if mode == "warm" else []

        def agent(n):  # noqa: ANN001, ANN202
            return h.torchrun(
                n, 1, [*entry, *worker], run_id=run_id, nnodes="1:2", max_restarts=3,
                rdzv_conf=RDZV, log_path=os.path.join(root, f"agent-{n.name}.log"),
                env={**env[n.name], "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            )  # fmt: skip

        a, b, spare = h.nodes
        agents = [agent(a), agent(b)]
        _until(lambda: _steps(_records(run_dir))[1] >= 2, "the job to train", agents)
        agents.append(agent(spare))
        _until(lambda: _is_spare(h.store, run_id, agents[2].pid), "the spare to wait", agents)
        attempt, at = _steps(_records(run_dir))
        _until(lambda: _steps(_records(run_dir))[1] >= at + KILL_AFTER_STEPS, "steps", agents)
        t_kill = time.time()
        h.kill(b)
        _until(
            lambda: any(r["type"] == "step" for r in _after(_records(run_dir), attempt)),
            "the next attempt's first step",
            [agents[0], agents[2]],
        )
        first = next(r for r in _after(_records(run_dir), attempt) if r["type"] == "step")
        rep = build_report(run_dir, os.path.join(root, "report"))
    rows = [r for r in rep["restart_phases"] if r["attempt"] > attempt]
    return {
        "mode": mode,
        "kill_to_productive_s": first["t"] - t_kill,
        "phases": rows[0]["phases"] if rows else None,
    }


def _after(records: list[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    """The records of attempts after ``attempt`` (a job_start opens each)."""
    out, on = [], False
    for r in records:
        if r["type"] == "job_start":
            on = r["attempt"] > attempt
        if on:
            out.append(r)
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=5, help="node losses per mode")
    p.add_argument("--out", default=os.path.join(HERE, "results", "spare_warm.json"))
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="spare-warm-")
    results: dict[str, Any] = {
        "command": " ".join(["bench/spare_warm.py", *sys.argv[1:]]),
        "load_average_start": os.getloadavg(),
        "trials": [],
    }
    try:
        for i in range(args.faults):
            for mode in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                r = trial(mode, os.path.join(root, f"{mode}-{i}"))
                results["trials"].append(r)
                print(f"{mode} #{i}: kill -> next productive step {r['kill_to_productive_s']:.2f}"
                      f" s; phases {json.dumps(r['phases'])}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode in ("cold", "warm"):
        rows = [t for t in results["trials"] if t["mode"] == mode]
        names = [k for k in (rows[0]["phases"] or {})] if rows else []
        results[mode] = {
            "kill_to_productive_s": _spread([t["kill_to_productive_s"] for t in rows]),
            "phases": {
                k: _spread([t["phases"].get(k, 0.0) for t in rows if t["phases"]]) for k in names
            },
        }
    cold, warm = (results[m]["kill_to_productive_s"]["median"] for m in ("cold", "warm"))
    results["warm_over_cold"] = warm / cold
    results["load_average_end"] = os.getloadavg()
    print(f"median kill -> next productive step: cold {cold:.2f} s, warm {warm:.2f} s "
          f"(warm/cold {warm / cold:.2f})")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
