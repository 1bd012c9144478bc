"""A run with the memory tier still ends on a durable checkpoint: a memory generation, or a
restore from memory, never stands in for the final save (and the memory copy is removed only
once durable storage holds what it held)."""

from __future__ import annotations

import glob
import os
import time

import torch
from torch import nn

from steadytrain import Run
from steadytrain.checkpoint.inspect import list_checkpoints


def _train(run_dir: str, mem: str, until: int) -> Run:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    states = {"model": model, "optim": optim}
    checkpoint = {"every_steps": 4, "memory": {"every_steps": 1, "dir": mem}}
    with Run(run_dir, states, rank=0, world_size=1, checkpoint=checkpoint) as run:
        for step in range(run.start_step + 1, until + 1):
            model(torch.ones(1, 8)).sum().backward()
            optim.step()
            time.sleep(0.1)  # the step's work: the background save of step 4 lands meanwhile
            run.step_done(step, tokens=8)
    return run


def _committed(run_dir: str) -> list[int]:
    rows = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    return sorted(r["step"] for r in rows if r["state"] == "committed")


def test_the_final_step_is_saved_durably_and_memory_is_released(tmp_path):
    run_dir, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    _train(run_dir, mem, 7)
    assert _committed(run_dir)[-1] == 7  # not only the memory generation of step 7
    assert glob.glob(os.path.join(mem, "*", "rank*", "*.snap")) == []


def test_a_memory_restore_of_the_last_step_is_then_saved_durably(tmp_path):
    run_dir, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    states = {"model": model, "optim": optim}
    from steadytrain.checkpoint import Checkpointer

    ck = Checkpointer(
        os.path.join(run_dir, "checkpoints"), every_steps=4, memory={"every_steps": 1, "dir": mem}
    )
    for step in range(1, 7):
        ck.maybe_save(step, states)
    ck.wait()  # dies here: durable holds 4, memory 6
    run = _train(run_dir, mem, 6)  # restores 6 from memory and has nothing left to train
    assert run.start_step == 6
    assert _committed(run_dir)[-1] == 6


def test_an_unusable_memory_directory_turns_the_tier_off_and_training_goes_on(tmp_path, caplog):
    from steadytrain.checkpoint import Checkpointer

    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "mem")  # under a regular file: never a directory
    model = nn.Linear(4, 4)
    states = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    events: list[dict] = []
    memory = {"every_steps": 1, "dir": bad}
    ck = Checkpointer(str(tmp_path / "ck"), every_steps=2, memory=memory, on_event=events.append)
    for step in range(1, 4):
        ck.maybe_save(step, states)
    ck.close()
    # one record says the tier is off (and why), then only the durable checkpoints
    got = [(e["type"], e["step"], e["ok"]) for e in events]
    assert got == [("memory_snapshot", 0, False), ("checkpoint", 2, True)], events
    assert "memory tier off" in events[0]["error"] and bad in events[0]["error"]
    assert any(bad in r.getMessage() and "checkpoint.memory.dir" in r.getMessage()
               for r in caplog.records), caplog.text  # fmt: skip
    again = Checkpointer(str(tmp_path / "ck"), memory=memory)
    assert again.restore_latest(states) == 2
    assert again.last_event["tier"] == "durable"
    assert bad in again.last_event["skipped"][0]["path"]
