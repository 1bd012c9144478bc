"""How a run went on after a failure, from the files it left: its steps against a
reference run's, which rank ran on which node, what each process fetched. (Which node was
lost, and why, is the report's to say: steadytrain.diagnose.)

Shared by the incident replays (``node_loss``) and their tests; it reads a run directory
(``trace-rank*.jsonl``, ``ranks/``, ``ledger.jsonl``, ``final.json``) and a node's log.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import defaultdict
from typing import Any

from steadytrain.testing.incidents.common import read_trace

__all__ = ["FETCHED_RE", "compare", "effective", "fetched_lines", "final", "measured", "rank_nodes"]

# What each training process says on its way out (train/support.py, say_fetched).
FETCHED_RE = re.compile(
    r"\[train\] node (?P<node>\S+) rank (?P<rank>\d+): fetched (?P<files>\d+) shard "
    r"file\(s\) \((?P<bytes>\d+) bytes"
)


def effective(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per step, what the finished run trained on: the newest attempt's records of that step.

    ``{step: {"loss", "sample_ids" (rank 0's, then rank 1's, ...), "world", "nodes"}}``; a
    step redone after a crash counts once, from the attempt that went on (``attempt_id``:
    the start time rank 0 chose for that attempt, shared by all ranks).
    """
    by_step: dict[int, dict[float, dict[int, dict[str, Any]]]] = defaultdict(dict)
    for r in records:
        by_step[r["step"]].setdefault(r["attempt_id"], {})[r["rank"]] = r
    out = {}
    for step, attempts in sorted(by_step.items()):
        recs = attempts[max(attempts)]
        ranks = sorted(recs)
        world = recs[ranks[0]]["world"]
        if ranks != list(range(world)):
            raise AssertionError(f"step {step}: trace has ranks {ranks} of a world of {world}")
        out[step] = {
            "loss": recs[0]["loss"],
            "sample_ids": [i for rk in ranks for i in recs[rk]["sample_ids"]],
            "world": world,
            "nodes": [recs[rk]["node"] for rk in ranks],
        }
    return out


def final(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "final.json")) as f:
        return json.load(f)


def compare(ref_dir: str, run_dir: str) -> dict[str, Any]:
    """How ``run_dir`` continued against the uninterrupted ``ref_dir``: per step sample ids
    and losses, and the final weights' SHA-256."""
    ref, got = effective(read_trace(ref_dir)), effective(read_trace(run_dir))
    steps = sorted(got)
    same_world = [s for s in steps if s in ref and got[s]["world"] == ref[s]["world"]]
    other = [s for s in steps if s in ref and s not in same_world]
    ids_differ = [s for s in steps if s not in ref or got[s]["sample_ids"] != ref[s]["sample_ids"]]
    loss_differs = [s for s in same_world if got[s]["loss"] != ref[s]["loss"]]
    rel = [abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in other]
    ref_final, run_final = final(ref_dir), final(run_dir)
    return {
        "steps": steps,
        "world_per_step": {s: got[s]["world"] for s in steps},
        "nodes_per_step": {s: got[s]["nodes"] for s in steps},
        "sample_ids_differ_at": ids_differ,
        "loss_differs_at_same_world": loss_differs,
        "steps_on_other_world": other,
        "max_rel_loss_diff_other_world": max(rel, default=0.0),
        "final_step": run_final["step"],
        "weights_sha256": run_final["weights"],
        "reference_weights_sha256": ref_final["weights"],
        "weights_equal": run_final["weights"] == ref_final["weights"],
        "bit_exact": not ids_differ and not loss_differs and not other
        and steps == sorted(ref) and run_final["weights"] == ref_final["weights"],
    }  # fmt: skip


def measured(run_dir: str) -> dict[str, Any]:
    """The newest attempt's world size and median step and compute time (rank 0's ledger):
    on 1 rank each step computes the whole global batch, on 2 ranks half of it each."""
    from steadytrain.monitor.ledger import read_ledger

    recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    starts = [r for r in recs if r.get("type") == "job_start"]
    last = max(i for i, r in enumerate(recs) if r.get("type") == "job_start") if starts else 0
    steps = [r for r in recs[last:] if r.get("type") == "step"]

    def median(key: str) -> float | None:
        xs = sorted(float(r[key]) for r in steps if r.get(key) is not None)
        return xs[len(xs) // 2] if xs else None

    return {
        "last_attempt_world": starts[-1].get("world_size") if starts else None,
        "last_attempt_steps": len(steps),
        "median_step_s": median("step_s"),
        "median_compute_s": median("compute_s"),
    }


def _rank_records(run_dir: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "ranks", "rank-*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line: a SIGKILL mid-write
    return out


def rank_nodes(run_dir: str) -> dict[str, list[str]]:
    """{rank: the nodes its ``rank_start`` records name} (keys are strings, as in JSON)."""
    out: dict[str, set[str]] = defaultdict(set)
    for r in _rank_records(run_dir):
        if r.get("type") == "rank_start":
            out[str(r["rank"])].add(str(r["node"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def fetched_lines(text: str) -> list[dict[str, Any]]:
    """Every ``fetched N shard file(s) (B bytes)`` line in a node's log."""
    return [
        {"node": m["node"], "rank": int(m["rank"]), "files": int(m["files"]),
         "bytes": int(m["bytes"])}
        for m in FETCHED_RE.finditer(text)
    ]  # fmt: skip
