"""The diagnosis matrix: faults the node harness injects, alone, together and on several
nodes, and clean runs; the report (steadytrain.diagnose) must find each, and nothing else.

Every case is the same small job (``STEPS`` steps of the tiny GPT, one rank per node, an
``s3://`` dataset of small shards read on demand inside ``next()`` into each node's own
cache) with its own faults, injected from outside as they happen on a cluster:

- ``storage``: the named nodes' object-store links slow down (``LATENCY_S`` each way) once
  step ``FAULT_AT`` is traced (``NodeHarness.slow_storage``);
- ``loader_memory``: the named nodes' ranks run the growing-index loader
  (steadytrain.testing.naive_loader), the others TokenLoader;
- ``kill``: the named node dies whole at step ``FAULT_AT`` (``NodeHarness.kill``; the job
  is elastic and continues on the others);
- ``stop``: the named node's rank is SIGSTOPped at step ``FAULT_AT`` (the hang watchdog
  and the node's reaper must end it);
- ``data_order``: topic-ordered documents read with ``data.shuffle=sequential``
  (steadytrain.testing.incidents.noisy_loss);
- ``cpu_quota``: the named nodes' processes are held to ``cpu_quota.QUOTA_CORES`` of a core
  once step ``FAULT_AT`` is traced (``NodeHarness.cpu_quota``: a cgroup CPU quota);
- ``eval_every``: no fault; every rank evaluates ``EVAL_BATCHES`` micro-batches every
  ``eval_every`` steps (``train.eval_every``): an evaluation-heavy clean run.

A case's ``expected`` incidents come from what was injected (which rank ran on which node
from the run's rank files), its ``incidents`` from ``steadytrain report --json`` alone, and
its ``check`` pairs them (steadytrain.testing.incidents.expect). Run it::

    python -m steadytrain.testing.incidents.matrix --cases storage+loader-memory --workdir DIR --json

``bench/diagnosis_matrix.py`` runs every case and 10 clean runs and writes precision and
recall; tests/nodes/test_diagnosis_matrix.py runs the combined cases within the CI budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from steadytrain.testing.incidents import (
    cpu_quota,
    elastic,
    loader_memory,
    node_loss,
    noisy_loss,
    storage,
)
from steadytrain.testing.incidents import hang as hang_replay
from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    incident_rows,
    last_step,
    read_trace,
    report,
    small_shards,
)
from steadytrain.testing.incidents.expect import check, expectation, node_ranks, score
from steadytrain.testing.nodes import Node, NodeHarness

__all__ = [
    "CASES",
    "CI_CASES",
    "CLEAN_CASES",
    "Case",
    "expected",
    "injected",
    "run_case",
    "run_cases",
]

STEPS, FAULT_AT, LATENCY_S = 24, 4, 0.1
DATA_ORDER_STEPS = noisy_loss.STEPS
# The evaluation-heavy clean run: about as long in evaluation as in training steps.
EVAL_EVERY, EVAL_BATCHES = 4, 120


@dataclass(frozen=True)
class Case:
    """One job of the matrix and the faults injected into it (node names)."""

    name: str
    nodes: int = 2
    storage: tuple[str, ...] = ()
    loader_memory: tuple[str, ...] = ()
    kill: str | None = None
    stop: str | None = None
    data_order: bool = False
    cpu_quota: tuple[str, ...] = ()
    eval_every: int = 0

    @property
    def steps(self) -> int:
        return DATA_ORDER_STEPS if self.data_order else STEPS

    @property
    def clean(self) -> bool:
        return not (self.storage or self.loader_memory or self.kill or self.stop
                    or self.data_order or self.cpu_quota)  # fmt: skip


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("storage", storage=("node-1",)),
        Case("loader-memory", loader_memory=("node-1",)),
        Case("node-loss", kill="node-1"),
        Case("hang", stop="node-1"),
        Case("data-order", data_order=True),
        # two kinds at once, on different nodes
        Case("storage+loader-memory", nodes=3, storage=("node-1",), loader_memory=("node-2",)),
        # one kind on 2 of 3 nodes: the healthy mode is the minority
        Case("storage-2-of-3", nodes=3, storage=("node-1", "node-2")),
        # one node held to a twentieth of a core: a compute straggler on an equally loaded host
        Case("cpu-quota", cpu_quota=("node-1",)),
        # clean, with every rank evaluating for about as long as it trains
        Case("eval-heavy", eval_every=EVAL_EVERY),
        Case("clean-2"),
        Case("clean-3", nodes=3),
    )
}
# What tests/nodes runs: the one case nothing else in the suite runs end to end (a node's
# processes held by a cgroup quota, read by its rank inside the node). The single kinds and
# clean runs come from the incident replays; the two 3-node combined cases' judgments are
# unit tests of the engine on synthetic records (tests/unit/test_diagnose_stragglers.py:
# two of three slow, storage and loader-memory on two nodes) and run here in the benchmark,
# which is where precision and recall are measured (issue 41: a suite in minutes).
CI_CASES = ("cpu-quota",)
# The clean runs the benchmark adds (``--clean N``); every other case is run once.
CLEAN_CASES = ("clean-2", "clean-3")


def expected(
    case: Case, run_dir: str, fault_step: int = FAULT_AT, quota_step: int | None = None
) -> list[dict[str, Any]]:
    """What the report must find in ``case``'s run (``fault_step``: the newest step traced
    when the kill or stop came, for ``node-loss`` and ``hang``; ``quota_step``: the newest
    step traced once a CPU quota was in place)."""
    out = []
    ranks = node_ranks(run_dir)
    if case.storage:
        exp = storage.expected(run_dir, list(case.storage), FAULT_AT, case.steps)
        # One incident for the slow nodes, or one per node: both say the right thing.
        exp["split_ok"] = len(case.storage) > 1
        out.append(exp)
    if case.loader_memory:
        out.append(loader_memory.expected(run_dir, list(case.loader_memory), case.steps))
    if case.kill:
        out.append(node_loss.expected(run_dir, case.kill, fault_step))
    if case.stop:
        # the stopped rank's last step, or the one the watchdog saw it stuck in
        near = (fault_step - 1, fault_step + 2)
        out.append(expectation("hang", [case.stop], ranks, near, near))
    if case.data_order:
        out.append(noisy_loss.expected(run_dir, case.steps))
    if case.cpu_quota:
        out.append(
            cpu_quota.expected(run_dir, list(case.cpu_quota), FAULT_AT, case.steps, quota_step)
        )
    return out


def _clear(path: str) -> None:
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def _settings(case: Case, url: str, ordered: str | None) -> tuple[list[str], dict[str, Any]]:
    """The job's ``--set`` settings and ``IncidentJob`` keywords."""
    if case.data_order:
        assert ordered is not None
        return [
            f"data.dataset={ordered}",
            f"data.seq_len={noisy_loss.SEQ_LEN}",
            f"data.global_batch={noisy_loss.GLOBAL_BATCH}",
            f"data.micro_batch={noisy_loss.MICRO_BATCH}",
            f"train.max_steps={case.steps}",
            "checkpoint.every_steps=1000",
            "optim.lr=3e-3",
            "data.shuffle=sequential",
        ], {}
    settings = [
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",
        "data.shuffle=global",
        # Reads on demand, inside next(): no shard prefetch, and no read-ahead thread. With
        # one, a rank's slow reads overlap its wait for a slower rank in the all-reduce, so
        # the lesser of two faults costs nothing; here each fault costs its own rank time.
        "data.prefetch_steps=0",
        "data.prefetch=0",
        f"data.global_batch={4 * case.nodes}",  # micro-batch 2, 2 accumulation steps a rank
        f"train.max_steps={case.steps}",
        "monitor.straggler_every_s=0.5",
    ]
    kw: dict[str, Any] = {}
    if case.kill:
        settings += [
            f"train.elastic_nnodes=1:{case.nodes}",
            f"checkpoint.every_steps={elastic.EVERY}",
        ]
        kw = {"nnodes": f"1:{case.nodes}", "max_restarts": 3, "rdzv_conf": elastic.RDZV}
    elif case.stop:
        settings += [
            f"checkpoint.every_steps={hang_replay.EVERY}",
            f"train.backend_timeout_s={hang_replay.BACKEND_TIMEOUT_S}",
            *hang_replay.WATCHDOG,
        ]
        kw = {"max_restarts": 2}
    else:
        settings.append("checkpoint.every_steps=1000")  # the final save only
    if case.eval_every:
        settings += [f"train.eval_every={case.eval_every}", f"train.eval_batches={EVAL_BATCHES}"]
    if case.kill or case.stop:
        # Paced steps around the fault, so it lands mid-run (each fires once per run).
        steps = ",".join(map(str, range(2, FAULT_AT + 4)))
        kw["env"] = {"STEADYTRAIN_FAULTS": f"slow_read_at_steps={steps};slow_read_s=0.2"}
    return settings, kw


def _worker_pids(job: IncidentJob, node: str) -> list[int]:
    """The training process(es) that ``node``'s torchrun agent started (forked from the
    node's warm process, or the agent's own children): those only (a rank's own helpers,
    such as the watchdog's reaper, are left running, as when an operator or a debugger
    stops one process)."""
    by_name = {n.name: n for n in job.nodes}
    return [p.pid for p in job.h.workers(by_name[node], job.agents[node])]


def run_case(
    h: NodeHarness, case: Case, run_dir: str, url: str, ordered: str | None, log: Log
) -> dict[str, Any]:
    """Run ``case`` on the harness's first ``case.nodes`` nodes; its report and check."""
    t0 = time.monotonic()
    nodes: list[Node] = h.nodes[: case.nodes]
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        _clear(n.cache_dir)
    settings, kw = _settings(case, url, ordered)
    log(f"[matrix] {case.name}: {case.steps} steps on {case.nodes} nodes ({run_dir})")
    if case.loader_memory:
        job = loader_memory.naive_job(
            h, nodes, run_dir, settings, naive_nodes=case.loader_memory, **kw
        )
    else:
        job = IncidentJob(h, nodes, run_dir, settings, **kw)
    fault_step = FAULT_AT
    victim = case.kill or case.stop
    quota = [by_name[n] for n in case.cpu_quota]
    quota_step: int | None = None
    try:
        if case.storage or victim or quota:
            job.wait_for_step(FAULT_AT, timeout=300)
            fault_step = max((r["step"] for r in read_trace(run_dir)), default=FAULT_AT)
        for name in case.storage:
            h.slow_storage(by_name[name], latency_s=LATENCY_S)
        cpu_quota.throttle(h, quota)
        # where the quota was surely in force (throttle takes a while on a loaded machine)
        quota_step = last_step(run_dir) if quota else None
        if case.kill:
            h.kill(by_name[case.kill])
        if case.stop:
            pids = _worker_pids(job, case.stop)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            log(f"[matrix] {case.name}: SIGSTOPped {case.stop}'s rank (pids {pids})")
        job.wait(timeout=600, expect={victim: None} if victim else None)
    finally:
        for name in case.storage:
            h.slow_storage(by_name[name])
        cpu_quota.lift(h, quota)
        for path in loader_memory.leftover_index_files(run_dir):
            os.unlink(path)
    rep = report(run_dir)
    incidents = incident_rows(rep, case.name)
    want = expected(case, run_dir, fault_step, quota_step)
    return {
        "case": case.name,
        "faults": asdict(case),
        "run_dir": run_dir,
        "report_html": rep.get("html"),
        "fault_step": fault_step,
        "quota_step": quota_step,
        "node_ranks": node_ranks(run_dir),
        "expected": want,
        "incidents": incidents,
        "check": check(want, incidents),
        # what the report charged to slower ranks (a straggler's cost leaves goodput)
        "goodput": rep.get("goodput"),
        "badput_s": {
            k: v
            for k, v in (rep.get("badput_s") or {}).items()
            if k in ("straggler_wait", "straggler_compute")
        },  # fmt: skip
        "seconds": time.monotonic() - t0,
    }


def injected(case: Case) -> list[tuple[str, list[str]]]:
    """(kind, nodes) of each fault in ``case``, as the harness injects them."""
    out = []
    if case.storage:
        out.append(("storage", list(case.storage)))
    if case.loader_memory:
        out.append(("loader-memory", list(case.loader_memory)))
    if case.kill:
        out.append(("node-loss", [case.kill]))
    if case.stop:
        out.append(("hang", [case.stop]))
    if case.data_order:
        out.append(("data-order", []))
    if case.cpu_quota:
        out.append(("host-contention", list(case.cpu_quota)))
    return out


def _failed(case: Case, run_dir: str, err: BaseException) -> dict[str, Any]:
    """A case whose job did not finish: every injected fault counts as missed."""
    want = [{"kind": k, "nodes": n, "first_step": None, "last_step": None}
            for k, n in injected(case)]  # fmt: skip
    return {
        "case": case.name,
        "faults": asdict(case),
        "run_dir": run_dir,
        "error": f"{type(err).__name__}: {err}"[-3000:],
        "expected": want,
        "incidents": [],
        "check": {"matched": [], "missed": [{"expected": e, "closest": []} for e in want],
                  "extra": []},
    }  # fmt: skip


def run_cases(names: list[str], workdir: str, *, log: Log) -> dict[str, Any]:
    """Each case in ``names`` (repeats allowed) one after another on one harness."""
    t0 = time.monotonic()
    cases = [CASES[n] for n in names]
    os.makedirs(workdir, exist_ok=True)
    url, ordered = "", None
    results = []
    h = NodeHarness(
        os.path.join(workdir, "harness"),
        nodes=max(c.nodes for c in cases),
        cache_size="32M",
        log=log,
    )
    with h:
        if any(not c.data_order for c in cases):
            url = h.put_dataset(small_shards(os.path.join(workdir, "dataset")), "small-shards")
        if any(c.data_order for c in cases):
            tokens = int(DATA_ORDER_STEPS * noisy_loss.GLOBAL_BATCH * noisy_loss.SEQ_LEN * 1.05)
            ordered = noisy_loss.ordered_documents(os.path.join(workdir, "ordered"), tokens=tokens)
        for i, case in enumerate(cases):
            run_dir = os.path.join(workdir, f"{i:02d}-{case.name}")
            try:
                results.append(run_case(h, case, run_dir, url, ordered, log))
            except Exception as e:  # noqa: BLE001 - one failed case must not end the matrix
                log(f"[matrix] {case.name}: FAILED: {e}")
                results.append(_failed(case, run_dir, e))
            r = results[-1]
            log(f"[matrix] {case.name}: {len(r['check']['matched'])} found, "
                f"{len(r['check']['missed'])} missed, {len(r['check']['extra'])} false; "
                f"incidents {[(i.get('kind'), i.get('nodes')) for i in r['incidents']]}")  # fmt: skip
        mode, reason = h.mode, h.reason
    leftovers = h.leftovers()
    shutil.rmtree(os.path.join(workdir, "harness", "seaweed"), ignore_errors=True)
    return {
        "mode": mode,
        "mode_reason": reason,
        "cases": results,
        "score": score(r["check"] for r in results),
        "seconds": time.monotonic() - t0,
        "leftovers": leftovers,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steadytrain.testing.incidents.matrix")
    p.add_argument("--cases", default=",".join(CI_CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--workdir", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    out = run_cases(names, os.path.abspath(args.workdir), log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(json.dumps(out["score"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
