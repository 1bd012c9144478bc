"""What a replay or a matrix case expects the report to diagnose, and how its incidents are
scored against that.

The harness knows which fault it injected, where and when; the product (``steadytrain
report --json``'s ``incidents``, from ``steadytrain.diagnose``) must say so on its own. An
expectation is a plain dict (it travels in a replay's JSON)::

    {"kind": "storage",                 # a kind of steadytrain.diagnose.KINDS
     "nodes": ["node-1"],               # the incident must name these nodes ...
     "allow_nodes": [],                 # ... and may also name these (a partition: both sides)
     "node_ranks": {"node-1": [1]},     # the ranks each of those nodes ran (its rank files)
     "check_ranks": true,               # ranks = the ranks of the nodes it names
     "first_step": [4, 12],             # inclusive bounds of the incident's first_step
     "last_step": [18, 24],             # ... and of its last_step (null: not checked)
     "split_ok": false}                 # several nodes: one incident each also matches

``check(expected, incidents)`` pairs each expectation with at most one incident (kind,
nodes, ranks and steps all right); incidents left over are false alarms, expectations left
over are misses. ``score`` turns a set of checks into precision and recall.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "check",
    "describe",
    "expectation",
    "judge",
    "node_ranks",
    "problems",
    "run_incidents",
    "score",
    "verify",
]


def _rank_starts(run_dir: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "ranks", "rank-*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line: a SIGKILL mid-write
                if rec.get("type") == "rank_start":
                    out.append(rec)
    return out


def node_ranks(run_dir: str, attempt: int | None = None) -> dict[str, list[int]]:
    """{node: the ranks it ran} in ``attempt`` (default: the run's first), from the rank
    files' ``rank_start`` records: which rank sat on which node is torchrun's choice, so a
    test learns it from the run, never assumes it."""
    starts = _rank_starts(run_dir)
    if attempt is None:
        attempt = min((int(r.get("attempt", 0)) for r in starts), default=0)
    out: dict[str, set[int]] = defaultdict(set)
    for r in starts:
        if int(r.get("attempt", 0)) == attempt:
            out[str(r["node"])].add(int(r["rank"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def expectation(
    kind: str,
    nodes: Sequence[str],
    ranks_by_node: dict[str, list[int]],
    first_step: tuple[int, int],
    last_step: tuple[int, int] | None = None,
    *,
    allow_nodes: Sequence[str] = (),
    check_ranks: bool = True,
) -> dict[str, Any]:
    """One expected incident (see the module docstring); ``ranks_by_node`` from
    ``node_ranks`` of the attempt the fault hit."""
    named = [*nodes, *allow_nodes]
    return {
        "kind": kind,
        "nodes": sorted(nodes),
        "allow_nodes": sorted(allow_nodes),
        "node_ranks": {n: list(ranks_by_node.get(n, [])) for n in sorted(named)},
        "check_ranks": check_ranks,
        "first_step": list(first_step),
        "last_step": None if last_step is None else list(last_step),
    }


def _within(v: Any, bounds: Sequence[int] | None) -> bool:
    return bounds is None or (isinstance(v, int) and bounds[0] <= v <= bounds[1])


def problems(exp: dict[str, Any], inc: dict[str, Any]) -> list[str]:
    """Why ``inc`` (one report incident) is not the expected one; empty when it is."""
    out = []
    if inc.get("kind") != exp["kind"]:
        return [f"kind {inc.get('kind')!r}, expected {exp['kind']!r}"]
    got = set(inc.get("nodes") or [])
    need, may = set(exp["nodes"]), set(exp["nodes"]) | set(exp["allow_nodes"])
    if not need <= got <= may:
        out.append(f"nodes {sorted(got)}, expected {sorted(need)}"
                   + (f" (may add {exp['allow_nodes']})" if exp["allow_nodes"] else ""))  # fmt: skip
    if exp["check_ranks"]:
        want = sorted({r for n in got & may for r in exp["node_ranks"].get(n, [])})
        if sorted(inc.get("ranks") or []) != want:
            out.append(f"ranks {inc.get('ranks')}, expected {want}")
    if not _within(inc.get("first_step"), exp["first_step"]):
        out.append(f"first_step {inc.get('first_step')}, expected in {exp['first_step']}")
    if not _within(inc.get("last_step"), exp["last_step"]):
        out.append(f"last_step {inc.get('last_step')}, expected in {exp['last_step']}")
    return out


def check(
    expected: Iterable[dict[str, Any]], incidents: Iterable[dict[str, Any]]
) -> dict[str, Any]:
    """Pair expectations with incidents: ``{"matched": [[exp, inc]], "missed": [{"expected",
    "closest"}], "extra": [inc]}``. ``closest``: the same-kind incidents and what is wrong
    with each (a wrong node is both a miss and a false alarm)."""
    left = list(incidents)
    matched, missed = [], []
    for exp in expected:
        hit = next((i for i in left if not problems(exp, i)), None)
        if hit is not None:
            left.remove(hit)
            matched.append([exp, hit])
            continue
        split = _split_match(exp, left)
        if split is not None:
            for i in split:
                left.remove(i)
            matched.append([exp, split])
            continue
        near = [
            {"incident": _brief(i), "problems": problems(exp, i)}
            for i in left
            if i.get("kind") == exp["kind"]
        ]
        missed.append({"expected": exp, "closest": near})
    return {"matched": matched, "missed": missed, "extra": left}


def _split_match(exp: dict[str, Any], left: list[dict[str, Any]]) -> list[dict] | None:
    """With ``split_ok`` (one fault on several nodes), one incident per node also matches:
    the incidents found, or None unless every node has its own."""
    if not exp.get("split_ok") or len(exp["nodes"]) < 2:
        return None
    found: list[dict[str, Any]] = []
    for node in exp["nodes"]:
        one = {**exp, "nodes": [node], "allow_nodes": [], "split_ok": False}
        hit = next((i for i in left if i not in found and not problems(one, i)), None)
        if hit is None:
            return None
        found.append(hit)
    return found


def _brief(inc: dict[str, Any]) -> dict[str, Any]:
    keys = ("kind", "nodes", "ranks", "first_step", "last_step", "lost_s", "run")
    return {k: inc.get(k) for k in keys if k in inc}


def describe(result: dict[str, Any]) -> str:
    """A check's result in a few lines (a failing test's message)."""
    lines = []
    for m in result["missed"]:
        e = m["expected"]
        lines.append(
            f"MISSED {e['kind']} on {e['nodes']} steps {e['first_step']}..{e['last_step']}"
        )
        lines += [f"  near: {json.dumps(c['incident'])}: {'; '.join(c['problems'])}"
                  for c in m["closest"]]  # fmt: skip
    lines += [f"EXTRA {json.dumps(_brief(i))}" for i in result["extra"]]
    return "\n".join(lines) or "ok"


def score(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Precision (matched / incidents reported) and recall (matched / expected) over many
    checks; 1.0 where the denominator is 0 (nothing expected, nothing reported)."""
    tp = fp = fn = 0
    for r in results:
        tp += len(r["matched"])
        fn += len(r["missed"])
        fp += len(r["extra"])
    return {
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
    }


def run_incidents(out: dict[str, Any], run: str) -> list[dict[str, Any]]:
    """A replay's incidents of one of its runs (``run``: the tag ``incident_rows`` set)."""
    return [i for i in out.get("incidents", []) if i.get("run") == run]


def judge(
    expected: dict[str, list[dict[str, Any]]], incidents: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``check`` per run of a replay: ``expected`` maps each run to what was injected in it
    (``[]``: a clean run, where any incident is a false alarm)."""
    return {run: check(exp, run_incidents({"incidents": incidents}, run))
            for run, exp in expected.items()}  # fmt: skip


def verify(out: dict[str, Any], run: str) -> list[Any]:
    """Check a replay's run afresh from its ``expected`` and the report's incidents; raise
    ``AssertionError`` (with what was missed and what was extra) unless every expected
    incident was found and nothing else. Returns the matched incidents, in order."""
    result = check(out["expected"][run], run_incidents(out, run))
    if result["missed"] or result["extra"]:
        raise AssertionError(f"{out.get('incident', '?')} {run}: {describe(result)}")
    return [inc for _, inc in result["matched"]]
