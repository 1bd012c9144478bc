"""Resuming a job whose settings changed: a new global batch continues at the saved sample
(and the restore event says so); settings that change the order, or the model's shapes, are
refused before any tensor is written, naming both values, and a checkpoint that verifies is
never called damaged, skipped for an older one, or offered for deletion.

Single process, real DCP checkpoints of a real ``TokenLoader`` (tests/unit/loader/conftest.py
writes the dataset).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.inspect import list_checkpoints
from steadytrain.data.read.loader import TokenLoader
from steadytrain.errors import CheckpointError

# The loader tests' dataset writer, loaded by path (a second module named "conftest" in
# sys.modules would shadow pytest's).
_spec = importlib.util.spec_from_file_location(
    "loader_datasets", os.path.join(os.path.dirname(__file__), "loader", "conftest.py")
)
_datasets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_datasets)
write_dataset = _datasets.write_dataset

pytestmark = pytest.mark.timeout(120)
SEQ = 16


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("ds")), [10, 14, 0, 16])


def _model(fill: float, out: int = 4) -> nn.Module:
    model = nn.Linear(8, out)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _loader(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=5)
    args.update(kw)
    return TokenLoader(ds, **args)


def _saved_run(ds, root, steps=(2, 3)) -> np.ndarray:
    """Checkpoints at ``steps`` of a G=8 run; returns the stream's sample ids 0..72."""
    with _loader(ds) as ld:
        ids = []
        ckpt = Checkpointer(str(root), every_steps=1, async_mode="sync", keep_last=5)
        for step in range(1, 10):
            for _ in range(ld.micro_per_step):
                ids.extend(next(ld)["sample_ids"].tolist())
            if step in steps:
                ckpt.save(step, {"model": _model(step), "loader": ld}, tokens_seen=step * 8)
        ckpt.close()
    return np.array(ids)


def test_a_new_global_batch_resumes_at_the_saved_sample_and_is_reported(ds, tmp_path):
    stream = _saved_run(ds, tmp_path / "ck")
    events: list[dict] = []
    model = _model(-1.0)
    with _loader(ds, global_batch=16) as ld:
        ckpt = Checkpointer(str(tmp_path / "ck"), on_event=events.append)
        assert ckpt.restore_latest({"model": model, "loader": ld}) == 3
        assert torch.all(model.weight == 3.0)
        got = np.concatenate([next(ld)["sample_ids"].numpy() for _ in range(16)])
    assert np.array_equal(got, stream[24:56]), "steps 4 and 5 are samples 24..56 of the stream"
    assert events[-1]["type"] == "restore" and events[-1]["skipped"] == []
    assert events[-1]["changes"] == [
        {"state": "loader", "key": "global_batch", "old": 8, "new": 16, "step": 3, "position": 24}
    ]


@pytest.mark.parametrize("verify", ["full", "overlap"])
def test_another_seq_len_is_refused_before_any_tensor_and_nothing_is_called_damaged(
    ds, tmp_path, verify
):
    _saved_run(ds, tmp_path / "ck")
    model = _model(-1.0)
    with _loader(ds, seq_len=8) as ld, pytest.raises(CheckpointError) as err:
        Checkpointer(str(tmp_path / "ck"), verify=verify).restore_latest(
            {"model": model, "loader": ld}
        )
    msg = str(err.value)
    assert "saved with seq_len=16, loader has seq_len=8" in msg
    assert "step-00000003 verifies" in msg and "Nothing was loaded" in msg
    assert "keep it" in msg
    assert "remove" not in msg.lower() and "delete" not in msg.lower()
    assert torch.all(model.weight == -1.0), "no live tensor was written"
    rows = list_checkpoints(str(tmp_path / "ck"))
    assert [(r["name"], r["verifies"]) for r in rows] == [
        ("step-00000003", True),
        ("step-00000002", True),
    ], "both checkpoints are still there and intact"


def test_other_tensor_shapes_stop_the_restore_instead_of_starting_from_scratch(ds, tmp_path):
    """Before: DCP refused the shapes before writing anything, every candidate was skipped
    and restore_latest returned 0, so a run restarted from step 0 beside its checkpoints."""
    _saved_run(ds, tmp_path / "ck")
    model = _model(-1.0, out=5)
    with _loader(ds) as ld, pytest.raises(CheckpointError) as err:
        Checkpointer(str(tmp_path / "ck")).restore_latest({"model": model, "loader": ld})
    msg = str(err.value)
    assert "step-00000003 verifies, but this job cannot load it" in msg and "Size" in msg
    assert "remove" not in msg.lower() and "delete" not in msg.lower()
    assert torch.all(model.weight == -1.0)


def test_a_missing_state_name_is_refused_before_any_tensor(ds, tmp_path):
    _saved_run(ds, tmp_path / "ck")
    model = _model(-1.0)
    with _loader(ds) as ld, pytest.raises(CheckpointError, match="no state named 'data'"):
        Checkpointer(str(tmp_path / "ck")).restore_latest({"model": model, "data": ld})
    assert torch.all(model.weight == -1.0)
