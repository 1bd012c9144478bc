"""``steadytrain train`` with FSDP2 recovered in place (issue 44 section 2): 2 ranks under
torchrun, every rank under the keeper (``run_demo_training(inplace=True)``: the keeper runs
``steadytrain/inplace/train_entry.py``), ``train.parallel=fsdp``, the memory tier's snapshot
every step, rank 0 SIGKILLed in the middle of step 11 (after its backward).

The trainer forms its group before it shards the model (``run_inplace.form_group``); after
the kill the survivor keeps its process, the keeper forks a replacement, and every rank
restores its own shard from the memory tier at the newest step both hold. Checked:

- one ``inplace_recovery`` record, path ``in_place``, rolled back to the memory tier's step,
  and no whole restart (torchrun's agent never restarted the ranks);
- the run equals the same run without the kill: every step's samples (each once) and loss,
  and the final weights, bit for bit (the trace of the survivor names the redone step's
  samples once, under the attempt that went on).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import BASE_SETTINGS, assert_same_run, ledger  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

STEPS, KILL_AT, EVERY = 16, 11, 4
FSDP = ["train.parallel=fsdp", "checkpoint.memory.every_steps=1"]


def test_the_trainers_fsdp2_rank_is_recovered_in_place_and_the_run_stays_exact(
    dataset: str, tmp_path
) -> None:
    from steadytrain.train.demo_run import run_demo_training

    settings = [s for s in BASE_SETTINGS if not s.startswith("checkpoint.every_steps")] + FSDP
    runs, said = {}, {}
    for name, crashes in (("ref", []), ("killed", [KILL_AT])):
        lines = said[name] = []
        runs[name] = run_demo_training(
            str(tmp_path / name),
            dataset,
            steps=STEPS,
            every_steps=EVERY,
            crashes=crashes,
            save_crashes=[],
            max_restarts=1,
            settings=settings,
            out=lines.append,
            inplace=True,
        )
        assert not [line for line in lines if "in-place recovery is off" in line], lines

    killed = runs["killed"]["run_dir"]
    records = ledger(killed)
    recs = [r for r in records if r["type"] == "inplace_recovery"]
    assert [(r["path"], r["failed_ranks"], r["from_step"]) for r in recs] == [
        ("in_place", [0], KILL_AT - 1)  # the steps done when step 11 failed
    ], recs
    step = recs[0]["step"]
    assert KILL_AT - 3 <= step <= KILL_AT - 1, recs  # the newest snapshot both ranks hold
    assert f"rolled back to the memory tier's step {step}" in recs[0]["why"], recs
    restores = [r for r in records if r["type"] == "restore" and r["step"] == step]
    assert [r["tier"] for r in restores] == ["local-memory"], restores
    # the keeper replaced rank 0 in place; torchrun's agent saw no failure (no restart)
    assert any("replacing it in place (1 of" in line for line in said["killed"]), said
    assert not [line for line in said["killed"] if line.startswith("[torchrun]")], said
    assert [r["reason"] for r in records if r["type"] == "job_end"][-1] == "finished"
    assert [r for r in ledger(runs["ref"]["run_dir"]) if r["type"] == "inplace_recovery"] == []

    assert_same_run(killed, runs["ref"]["run_dir"], STEPS, global_batch=8)
