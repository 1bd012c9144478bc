"""The run's nonce in durable checkpoints (issue 40, item 2): every COMMIT carries the run's
``run_nonce``; a checkpoint of another run is passed over with the reason, one without a
nonce (written before run identities) still restores; ``newest_run_nonce`` reads the newest
COMMIT's nonce, so a run whose run directory was lost adopts it and resumes. One process."""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn

from steadytrain import Run
from steadytrain.checkpoint import Checkpointer
from steadytrain.run_identity import new_nonce


def _states() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _saved(root, step: int, nonce: str | None) -> None:
    ck = Checkpointer(str(root), async_mode="sync")
    ck.run_nonce = nonce
    ck.save(step, _states())
    ck.close()


def _commit(root, step: int) -> dict:
    with open(os.path.join(root, f"step-{step:08d}", "COMMIT")) as f:
        return json.load(f)


def test_a_commit_names_its_run_and_another_runs_checkpoint_is_passed_over(tmp_path):
    ours, theirs = new_nonce(), new_nonce()
    _saved(tmp_path, 2, ours)
    _saved(tmp_path, 4, theirs)  # newer, of another run (a shared checkpoint directory)
    assert _commit(tmp_path, 2)["run_nonce"] == ours
    ck = Checkpointer(str(tmp_path))
    assert ck.newest_run_nonce() == theirs  # one listing, one COMMIT
    ck.run_nonce = ours
    assert ck.restore_latest(_states()) == 2  # not step 4
    (why,) = [s["reason"] for s in ck.last_event["skipped"] if s["step"] == 4]
    assert (
        why.startswith(f"written by another run (nonce {theirs[:12]}...") and "run-identity" in why
    )


def test_a_commit_without_a_nonce_still_restores(tmp_path):
    _saved(tmp_path, 3, None)  # as written before run identities
    assert "run_nonce" not in _commit(tmp_path, 3)
    ck = Checkpointer(str(tmp_path))
    assert ck.newest_run_nonce() is None
    ck.run_nonce = new_nonce()
    assert ck.restore_latest(_states()) == 3 and ck.last_event["skipped"] == []


def test_a_run_whose_run_directory_was_lost_adopts_its_checkpoints_and_resumes(tmp_path):
    ckpt_dir, run_dir = str(tmp_path / "ckpts"), str(tmp_path / "run")
    with Run(run_dir, _states(), checkpoint={"every_steps": 2}, checkpoint_dir=ckpt_dir) as run:
        for step in range(1, 5):
            run.step_done(step)
        nonce = run.nonce
    assert _commit(ckpt_dir, 4)["run_nonce"] == nonce
    shutil.rmtree(run_dir)  # the run directory is lost, the checkpoints are kept
    with Run(run_dir, _states(), checkpoint={"every_steps": 2}, checkpoint_dir=ckpt_dir) as run:
        assert run.nonce == nonce and run.start_step == 4
    # a new run directory that already has its own identity is another run: it does not
    # take the old run's checkpoints
    other = str(tmp_path / "other")
    with Run(other, _states(), checkpoint=False):
        pass
    with Run(other, _states(), checkpoint={"every_steps": 2}, checkpoint_dir=ckpt_dir) as run:
        assert run.start_step == 0
        skipped = run.checkpointer.last_event["skipped"]
        assert skipped and all("written by another run" in s["reason"] for s in skipped)
