"""``Run`` with in-place recovery of an FSDP2 job (issue 44 section 2), under the real
torchrun, 2 and 3 gloo ranks, the keeper, ``--max-restarts 1``: ``inplace_fsdp_worker.py``,
whose rank 0 SIGKILLs itself in step 7 between its forward and its backward (the others
blocked in the backward's all-gather).

FSDP2's shards are each rank's own: no survivor can hand the replacement its state. With
the memory tier on (a snapshot every step), every rank restores its own shard from it at
the newest step every rank holds, after the regroup, on the rebuilt checkpointer:

- torchrun never restarts the job and the survivors keep their processes;
- one ``inplace_recovery`` record, path ``in_place``, "rolled back to the memory tier's
  step N", and the attempt's restore is of the memory tier;
- the run equals an uninterrupted one run beside it: every step's loss on each rank (the
  redone steps too) and the final weights, bit for bit.

With the memory tier off there is no step every rank holds: the recovery falls back to
torchrun's whole restart (from the newest durable checkpoint), and the next attempt's
record says why (``no_common_step``).
"""

from __future__ import annotations

import os

import pytest
from example_runs import assert_same_as_uninterrupted, finish, jsonl
from warm_pool import start_inplace

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "inplace_fsdp_worker.py")
STEPS, KILL_AT = 12, 7


def start(run_dir: str, kill_at: int, memory_every: int, ranks: int = 2):
    args = (run_dir, str(STEPS), str(kill_at), str(memory_every))
    return start_inplace(WORKER, *args, ranks=ranks)


def recoveries(run_dir: str) -> list[dict]:
    ledger = jsonl(os.path.join(run_dir, "ledger.jsonl"))
    return [r for r in ledger if r["type"] == "inplace_recovery"]


@pytest.mark.parametrize("ranks", [2, 3], ids=["2-ranks", "3-ranks"])
def test_fsdp2_rank_recovers_in_place_from_the_memory_tier_and_stays_exact(
    tmp_path, ranks: int
) -> None:
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    logs = [finish(p) for p in [start(ref, 0, 1, ranks), start(killed, KILL_AT, 1, ranks)]]

    assert "replacing it in place (1 of 3)" in logs[1], logs[1][-4000:]
    replaced = jsonl(os.path.join(killed, "r0.jsonl"))
    for survivor in range(1, ranks):
        kept = jsonl(os.path.join(killed, f"r{survivor}.jsonl"))
        assert {r["restart"] for r in kept + replaced} == {"0"}, "torchrun restarted the job"
        assert len({r["pid"] for r in kept}) == 1, "a survivor's process was replaced"
    (rec,) = recoveries(killed)
    step = rec["step"]
    assert (rec["path"], rec["failed_ranks"], rec["from_step"]) == ("in_place", [0], KILL_AT)
    # the snapshot of the last step is written in the background: it or the one before
    assert KILL_AT - 2 <= step <= KILL_AT, rec
    assert f"rolled back to the memory tier's step {step}" in rec["why"], rec
    assert set(rec["phases"]) >= {"detection_s", "regroup_s", "restore_s", "redo_s"}
    # the survivors redid the rolled-back steps; the replacement started at the step
    for survivor in range(1, ranks):
        kept = jsonl(os.path.join(killed, f"r{survivor}.jsonl"))
        assert [r["step"] for r in kept] == list(range(KILL_AT)) + list(range(step, STEPS))
    assert [r["step"] for r in replaced if r["incarnation"] == 1] == list(range(step, STEPS))
    ledger = jsonl(os.path.join(killed, "ledger.jsonl"))
    restores = [r for r in ledger if r["type"] == "restore" and r["step"] == step]
    assert [r["tier"] for r in restores] == ["local-memory"], restores
    assert_same_as_uninterrupted(ref, killed, STEPS, ranks)  # losses, redone ones too; weights
    assert recoveries(ref) == []


def test_fsdp2_without_the_memory_tier_falls_back_to_the_whole_restart(tmp_path) -> None:
    killed = str(tmp_path / "killed")
    log = finish(start(killed, KILL_AT, 0))

    assert "FSDP2's shards come back from the memory tier, which is off" in log  # at entry

    recs = recoveries(killed)
    assert recs and {r["path"] for r in recs} == {"whole_restart"}, recs
    assert {r["fallback"] for r in recs} == {"no_common_step"}, recs
    assert any("the memory tier is off" in r["why"] for r in recs), recs
    rows = jsonl(os.path.join(killed, "r1.jsonl"))
    assert {r["restart"] for r in rows} == {"0", "1"}  # torchrun's whole restart ran
    # from the newest durable checkpoint: step 4's, unless its thread-async save was still
    # in flight at the kill (seen under load), then from the start
    starts = [r for r in jsonl(os.path.join(killed, "ledger.jsonl")) if r["type"] == "job_start"]
    restored = starts[-1]["restored_step"]
    assert len(starts) == 2 and restored in (0, 4), starts
    assert [r["step"] for r in rows if r["restart"] == "1"] == list(range(restored, STEPS))
