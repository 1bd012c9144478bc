"""``Run.save``: a save the caller decides (a trainer's ModelCheckpoint or save_strategy),
carried out by Run's checkpointer whatever its interval, its blocked time booked in the
record of the step it saved, and that step then held by the final save."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from steadytrain import Run
from steadytrain.monitor.ledger import read_ledger


def test_a_save_the_caller_decides_is_booked_in_its_steps_record(tmp_path):
    run_dir = str(tmp_path / "run")
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    states = {"model": model, "optim": optim}
    blocks = {}
    # No interval of its own (every_steps 0): only the caller's saves and the final one.
    with Run(run_dir, states, rank=0, world_size=1, checkpoint={"async_mode": "sync"}) as run:
        for step in (1, 2, 3):
            model(torch.ones(1, 64)).sum().backward()
            optim.step()
            if step == 2:
                blocks[step] = run.save(step, tokens_seen=2 * 8)
                assert run.pending_block_s == blocks[step]
            run.step_done(step, tokens=8)
            assert run.pending_block_s == 0.0
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert steps[2]["checkpoint_block_s"] == blocks[2] > 0
    assert steps[1]["checkpoint_block_s"] == steps[3]["checkpoint_block_s"] == 0.0
    saved = [(r["step"], r["ok"]) for r in records if r["type"] == "checkpoint"]
    assert saved == [(2, True), (3, True)]  # the caller's, then the final save of step 3
    commit = os.path.join(run_dir, "checkpoints", "step-00000002", "COMMIT")
    with open(commit) as f:
        assert json.load(f)["tokens_seen"] == 16  # the caller's count, not Run's running one


def test_the_final_save_skips_a_step_the_caller_saved(tmp_path):
    run_dir = str(tmp_path / "run")
    model = nn.Linear(4, 4)
    with Run(run_dir, {"model": model}, rank=0, world_size=1, checkpoint={}) as run:
        run.step_done(1, tokens=4)
        run.save(2)
        run.step_done(2, tokens=4)
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    assert [r["step"] for r in records if r["type"] == "checkpoint"] == [2]
