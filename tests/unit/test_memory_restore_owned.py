"""A local-memory restore maps the node's own snapshot file; the tier later rewrites that
very file for a newer generation. A tensor that a restored state keeps as it was given (an
optimizer's state, any Stateful's) and never writes must therefore be a copy of its own,
or it would change under the state's feet when the file is reused, two generations on."""

from __future__ import annotations

import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer


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


def _checkpointer(tmp_path) -> Checkpointer:
    memory = {"every_steps": 1, "dir": str(tmp_path / "mem")}
    return Checkpointer(str(tmp_path / "ck"), every_steps=1000, memory=memory)


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
