"""What a memory restore must not do to the live states, one process, no harness.

- A local-memory restore maps the node's own snapshot file, and the tier later rewrites that
  very file for a newer generation. A tensor that a restored state keeps as it was given (an
  optimizer's state, any Stateful's) and never writes must therefore be a copy of its own,
  or it would change under the state's feet when the file is reused, two generations on.
- A copy that does not fit the live model (another shape) is refused before any tensor is
  written: the durable checkpoint is then judged on its own (here: it does not fit either,
  and the error says nothing was loaded, which is true).
- A memory restore that fails half-way (the model loaded, another state refused) with no
  durable checkpoint to load over it stops the start: it never goes on from step 0."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.errors import CheckpointError


class Keeper:
    """A Stateful that keeps the tensor it is given and never writes it; what it saves
    is a new tensor of the current version (so each generation's bytes differ)."""

    def __init__(self) -> None:
        self.version = 0
        self.kept: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {"table": torch.full((4096,), float(self.version))}

    def load_state_dict(self, sd: dict) -> None:
        self.kept = sd["table"]
        self.version = int(sd["table"][0])


def _checkpointer(tmp_path, durable_every: int = 1000) -> Checkpointer:
    memory = {"every_steps": 1, "dir": str(tmp_path / "mem")}
    return Checkpointer(str(tmp_path / "ck"), every_steps=durable_every, memory=memory)


def test_a_kept_tensor_is_not_rewritten_when_its_snapshot_file_is_reused(tmp_path):
    keeper = Keeper()
    states = {"model": nn.Linear(4, 4), "keeper": keeper}
    ck = _checkpointer(tmp_path)
    for step in (1, 2, 3):
        keeper.version = step
        ck.maybe_save(step, states)
    ck.wait()  # dies here: memory holds generations 2 and 3

    again = Keeper()
    states = {"model": nn.Linear(4, 4), "keeper": again}
    ck = _checkpointer(tmp_path)
    assert ck.restore_latest(states) == 3
    assert again.kept is not None and torch.all(again.kept == 3.0)
    for step in (4, 5, 6):  # generation 5 reuses generation 3's file, 6 that of 4
        again.version = step
        ck.maybe_save(step, states)
        ck.wait()
    assert torch.all(again.kept == 3.0), again.kept[:4]
    ck.close()


def test_a_copy_that_does_not_fit_the_model_is_refused_before_anything_is_written(tmp_path):
    torch.manual_seed(0)
    states = {"model": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))}
    ck = _checkpointer(tmp_path, durable_every=1)
    for step in (1, 2):
        ck.maybe_save(step, states)
    ck.wait()  # dies here: memory and durable both hold step 2

    torch.manual_seed(1)
    wider = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8))  # its first layer still fits
    before = wider[0].weight.detach().clone()
    ck = _checkpointer(tmp_path, durable_every=1)
    with pytest.raises(CheckpointError, match="cannot load it") as err:
        ck.restore_latest({"model": wider})
    assert "Nothing was loaded" in str(err.value), err.value
    assert torch.equal(wider[0].weight, before)  # not a byte of the snapshot went in
    ck.close()


class Refuses:
    """A state whose loading fails after the model's has gone in (a user's object that
    rejects what it is given)."""

    def state_dict(self) -> dict:
        return {"x": torch.zeros(3)}

    def load_state_dict(self, sd: dict) -> None:
        raise ValueError("this object refuses the state it is given")


def test_a_load_that_fails_half_way_with_nothing_durable_stops_instead_of_starting_afresh(
    tmp_path,
):
    torch.manual_seed(0)
    states = {"model": nn.Linear(4, 4), "picky": Refuses()}
    ck = _checkpointer(tmp_path)  # durable every 1000 steps: memory only
    for step in (1, 2):
        ck.maybe_save(step, states)
    ck.wait()  # dies here

    torch.manual_seed(1)
    model = nn.Linear(4, 4)
    ck = _checkpointer(tmp_path)
    # the model took the snapshot's weights before the other state refused its own: going
    # on from step 0 with them would train a half-restored job as if it were a new one
    with pytest.raises(CheckpointError, match="failed while loading and no durable") as err:
        ck.restore_latest({"model": model, "picky": Refuses()})
    assert "refuses the state" in str(err.value) and "restart the process" in str(err.value)
    ck.close()
