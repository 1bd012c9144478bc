"""Incident replay ``hang``: one node's link goes down mid-run.

Two nodes, one rank each, train the tiny GPT under ``torchrun --nnodes 1:2`` (steps paced
to ``PACE_S`` by the ``slow_read`` fault so the partition lands mid-run, checkpoints every
``EVERY`` steps). Once step ``PARTITION_AT`` is done the harness takes node-1's link down
(``NodeHarness.partition``): neither rank's all-reduce can complete, and neither process
fails by itself. The same job runs twice:

- **without the fix**: the hang watchdog off (``monitor.watchdog.enabled=false``): the
  ranks sit in the collective until the backend's timeout (``train.backend_timeout_s`` =
  ``BACKEND_TIMEOUT_S``; torch's default for gloo is 30 min, which no replay can wait for);
- **with the fix**: the watchdog on with a ``FLOOR_S`` deadline: every rank dumps its
  stacks, publishes its verdict under ``RUN_DIR/hangs/``, rank 0 records the ``hang`` and
  all exit 124, seconds after the last progress.

In both, the link comes back once the failure is detected (``partition(down=False)``, as a
repaired link would), and torchrun restarts the job, which resumes from its last
checkpoint and finishes. ``--nnodes 1:2`` (and ``train.elastic_nnodes=1:2``) because the
partitioned node's agent cannot reach the rendezvous store while its link is down and may
give up: then node-0 goes on alone (the loader's order does not depend on the world
size); if node-1's agent survives it rejoins, as it did in our runs: in the next
rendezvous, or, when its agent sees its worker fail after node-0's rendezvous closed
(``last_call_timeout``; 10 s late in the suite's quiet run of bf12b28, load 5-13), in one
more: node-0's agent had started an attempt alone and stops it (SIGTERM) to admit node-1.
The report charges that restart to the hang (``diagnose/failures_rejoin.py``), not to a
crash of its own.

``detect_s`` per run is from the last progress before the partition to the failure: the
watchdog's detection (the ``hang`` record's ``detect_t``, from the detecting rank's own last
progress, its ``progress_t``: rank 0's step record is written after the step, and a rank
that fires on its deadline measured from its own, earlier, progress read 2.978 s against a
3.0 s deadline from it), or the attempt's end with the backend's error (its ``job_end``,
from the last step record); ``restart_s`` to the next attempt's process start:
timings the replay measures. The diagnosis is the report's alone (``incidents``): in both
runs one ``hang`` at the partition's step naming node-1 (``expected``, ``checks``).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from steadytrain.monitor.ledger import iter_ledger, ledger_path
from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    incident_rows,
    reports,
    run_summary,
    small_shards,
)
from steadytrain.testing.incidents.expect import expectation, judge, node_ranks
from steadytrain.testing.nodes import NodeHarness

__all__ = ["BACKEND_TIMEOUT_S", "FLOOR_S", "STEPS", "expected", "replay"]

STEPS = 20
EVERY = 4  # checkpoint interval (steps)
PARTITION_AT = 9  # the link goes down after this step (the checkpoint of step 8 exists)
PACE_S = 0.2  # each step's read stalls this long (once per step and rank): a steady pace
BACKEND_TIMEOUT_S = 15.0  # the gloo collective timeout of both runs (torch default: 30 min)
FLOOR_S = 3.0  # the watchdog's step deadline (tiny steps: k x p99 stays below it)
STEP_SLACK = 2  # a step or two may complete between the trace read and the link going down
RDZV = "last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=4"
PARTITIONED = "node-1"
WATCHDOG = [
    f"monitor.watchdog.floor_s={FLOOR_S}",
    "monitor.watchdog.k=4",  # 4 x p99 of a 0.2 s step stays under the floor on a busy machine
    "monitor.watchdog.poll_s=0.25",
    "monitor.watchdog.grace_s=2",
    "monitor.watchdog.warmup_steps=3",
    # below the backend timeout (with 2 x grace), or the watchdog warns that gloo fires first
    "monitor.watchdog.init_s=10",
    "monitor.watchdog.checkpoint_s=10",
]


def _records(run_dir: str) -> list[dict[str, Any]]:
    path = ledger_path(run_dir)
    return list(iter_ledger(path)) if path.exists() else []


def _failed(run_dir: str, after_t: float) -> bool:
    """The attempt running at ``after_t`` is over: a hang record, its job_end, or (had it
    died without one) the next attempt's job_start."""
    kinds = ("hang", "job_end", "job_start")
    return any(r["type"] in kinds and r.get("t", 0) >= after_t for r in _records(run_dir))


def _timing(run_dir: str, partitioned_t: float) -> dict[str, Any]:
    """From the ledger: the last progress before the partition, the failure, the restart."""
    recs = _records(run_dir)
    steps = [r for r in recs if r["type"] == "step" and r["t"] <= partitioned_t + 1.0]
    if not steps:
        raise RuntimeError(f"{ledger_path(run_dir)}: no step before the partition")
    last = max(steps, key=lambda r: r["t"])
    hang = next((r for r in recs if r["type"] == "hang"), None)
    starts = [r for r in recs if r["type"] == "job_start" and r["t"] > last["t"]]
    before = starts[0]["t"] if starts else float("inf")  # the hung attempt's own job_end
    end = next((r for r in recs if r["type"] == "job_end" and last["t"] < r["t"] < before), None)
    restart_t = None
    if starts:
        s = starts[0]
        restart_t = s["t"] - s.get("startup_s", 0) - s.get("restore_s", 0)
    # The failure: the watchdog's detection, else the attempt's end with the backend's
    # error, else (no job_end: it died without one) the next process start, an upper bound.
    fail_t = hang["detect_t"] if hang else (end["t"] if end else restart_t)
    since = hang.get("progress_t", last["t"]) if hang else last["t"]
    out: dict[str, Any] = {
        "last_step": last["step"],
        "detect_s": None if fail_t is None else fail_t - since,
        "detected_by": "watchdog" if hang else ("backend timeout" if fail_t else None),
        "error": (end or {}).get("reason") if end and not hang else None,
        "hang_record": hang,
        "restored_step": starts[0].get("restored_step") if starts else None,
        "restart_s": None if restart_t is None else restart_t - last["t"],
    }
    return out


def expected(run_dir: str) -> dict[str, Any]:
    """One ``hang`` at the partition, naming node-1 (its rank). Cut off, both sides wait in
    the same collective, so the report may name node-0 too; it may not miss node-1."""
    others = [n for n in node_ranks(run_dir) if n != PARTITIONED]
    near = (PARTITION_AT, PARTITION_AT + STEP_SLACK)
    return expectation("hang", [PARTITIONED], node_ranks(run_dir), near, near, allow_nodes=others)


def _one_run(h: NodeHarness, workdir: str, dataset: str, name: str, log: Log) -> dict[str, Any]:
    """One run, up to its end; its ``timing`` and its agents' exit codes (the report is
    built after both runs: ``replay``)."""
    run_dir = os.path.join(workdir, name)
    watchdog = WATCHDOG if name == "with_fix" else ["monitor.watchdog.enabled=false"]
    settings = [
        f"data.dataset={dataset}",
        f"train.max_steps={STEPS}",
        f"checkpoint.every_steps={EVERY}",
        f"train.backend_timeout_s={BACKEND_TIMEOUT_S}",
        "train.elastic_nnodes=1:2",
        *watchdog,
    ]
    pace = f"slow_read_at_steps={','.join(map(str, range(1, STEPS + 1)))};slow_read_s={PACE_S}"
    node = next(n for n in h.nodes if n.name == PARTITIONED)
    log(f"[hang] {name}: {STEPS} steps on 2 nodes, {PARTITIONED}'s link down after step "
        f"{PARTITION_AT} ({run_dir})")  # fmt: skip
    job = IncidentJob(
        h,
        h.nodes,
        run_dir,
        settings,
        nnodes="1:2",
        max_restarts=2,
        rdzv_conf=RDZV,
        env={"STEADYTRAIN_FAULTS": pace},
    )
    healed = False
    try:
        job.wait_for_step(PARTITION_AT, timeout=300)
        h.partition(node)
        partitioned_t = time.time()
        deadline = time.monotonic() + BACKEND_TIMEOUT_S + 120
        while not _failed(run_dir, partitioned_t):
            job.check_alive(allow_exit=[PARTITIONED])
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run_dir}: no failure recorded after the partition")
            time.sleep(0.1)
        h.partition(node, down=False)
        healed = True
        log(f"[hang] {name}: failure seen {time.time() - partitioned_t:.1f} s after the "
            "partition; link up")  # fmt: skip
        # node-1's agent may have given up while cut off: only node-0's must finish.
        codes = job.wait(timeout=BACKEND_TIMEOUT_S + 300, expect={PARTITIONED: None})
    finally:
        if not healed:
            h.partition(node, down=False)
    timing = _timing(run_dir, partitioned_t)
    return {
        "timing": timing,
        "summary": {
            "agent_exit_codes": codes,
            "partitioned_node": PARTITIONED,
            **{k: v for k, v in timing.items() if k != "hang_record"},
        },
    }


def replay(workdir: str, *, log: Log) -> dict[str, Any]:
    """Both runs on a fresh 2-node harness under ``workdir``; see the module docstring."""
    t0 = time.monotonic()
    dataset = small_shards(os.path.join(workdir, "ds"), tokens=60_000, shard_tokens=4096)
    results: dict[str, dict[str, Any]] = {}
    os.makedirs(workdir, exist_ok=True)
    h = NodeHarness(os.path.join(workdir, "harness"), nodes=2, cache_size="32M", log=log)
    with h:
        if h.mode != "netns":
            raise RuntimeError(
                f"the hang replay partitions a node's link, which needs network namespaces "
                f"({h.reason}); run it as root where `ip netns add` works"
            )
        for name in ("without_fix", "with_fix"):
            results[name] = _one_run(h, workdir, dataset, name, log)
        mode, reason = h.mode, h.reason
    got = reports({name: os.path.join(workdir, name) for name in results})
    for name, r in results.items():
        r["report"] = got[name]
        r["summary"] = {**run_summary(os.path.join(workdir, name), got[name]), **r["summary"]}
    leftovers = h.leftovers()
    # The object store (unused here: the dataset is local) is not worth keeping.
    shutil.rmtree(os.path.join(workdir, "harness", "seaweed"), ignore_errors=True)
    incidents = []
    for name, r in results.items():
        incidents += incident_rows(r["report"], name)
    want = {name: [expected(r["summary"]["run_dir"])] for name, r in results.items()}
    detect = {k: r["timing"]["detect_s"] for k, r in results.items()}
    return {
        "incident": "hang",
        "mode": mode,
        "mode_reason": reason,
        "incidents": incidents,
        "expected": want,
        "checks": judge(want, incidents),
        "goodput": {k: r["report"].get("goodput") for k, r in results.items()},
        "runs": {k: r["summary"] for k, r in results.items()},
        "detect_s": detect,
        "restart_s": {k: r["timing"]["restart_s"] for k, r in results.items()},
        "backend_timeout_s": BACKEND_TIMEOUT_S,
        "watchdog_floor_s": FLOOR_S,
        "partitioned_node": PARTITIONED,
        "steps": STEPS,
        "seconds": time.monotonic() - t0,
        "leftovers": leftovers,
    }
