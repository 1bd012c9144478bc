"""A trainer's own state in a checkpoint (``integrations/trainer_state.py``): JSON with
tensors tagged, every value back as it was, untrusted input refused by name."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from steadytrain.errors import CheckpointError
from steadytrain.integrations.trainer_state import TAG, TrainerMeta, from_json, to_json


def _round_trip(value):
    return from_json(json.loads(json.dumps(to_json(value))))


def test_lightning_like_state_comes_back_equal() -> None:
    state = {
        "epoch": 0,
        "global_step": 8,
        "loops": {"fit_loop": {"state_dict": {}, "progress": {"total": {"ready": 16}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {
                "best_model_score": torch.tensor(0.25),
                "best_k_models": {
                    "a/step=4.ckpt": torch.tensor(0.5),
                    "a/step=8.ckpt": torch.tensor(0.25),
                },
                "kth_value": torch.tensor(float("inf")),
                "dirpath": "a",
            }
        },
        "lr_schedulers": [{"base_lrs": [0.003], "last_epoch": 8, "lr_lambdas": [None]}],
        "hyper_parameters": {"dims": (64, 128), "dtype": torch.bfloat16, 3: "int key"},
        "scaler": {"scale": torch.full((2, 3), 7.5, dtype=torch.bfloat16), "np": np.float32(1.5)},
        TAG: "a user's key that looks like ours",
        "nan": float("nan"),
    }
    got = _round_trip(state)
    assert set(got) == set(state)
    cb = got["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]
    assert cb["best_model_score"].dtype == torch.float32 and cb["best_model_score"].shape == ()
    assert torch.equal(cb["best_k_models"]["a/step=8.ckpt"], torch.tensor(0.25))
    assert math.isinf(cb["kth_value"].item())
    assert got["hyper_parameters"] == {"dims": (64, 128), "dtype": torch.bfloat16, 3: "int key"}
    assert torch.equal(got["scaler"]["scale"], state["scaler"]["scale"])
    assert got["scaler"]["np"] == 1.5
    assert got[TAG] == state[TAG] and got["loops"] == state["loops"]
    assert got["lr_schedulers"] == state["lr_schedulers"] and math.isnan(got["nan"])


def test_a_value_that_cannot_be_saved_warns_and_comes_back_as_none() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doc = to_json({"hparams": {"fn": lambda x: x}}, "state")
    assert "state.hparams.fn holds a function that cannot be saved" in str(caught[0].message)
    assert from_json(json.loads(json.dumps(doc))) == {"hparams": {"fn": None}}


class _Custom:  # an object only an unrestricted unpickler would make again
    pass


def test_an_object_needing_an_unrestricted_unpickler_is_refused_by_key() -> None:
    doc = json.loads(json.dumps(to_json({"hparams": {"obj": _Custom()}})))
    meta = TrainerMeta(dict, lambda _v: None)
    with pytest.raises(CheckpointError, match=r"state\.hparams\.obj is a _Custom"):
        meta.check_state_dict({"format": 1, "state": doc, "extra": {}})


@pytest.mark.parametrize(
    "bad",
    [
        {TAG: "tensor", "dtype": "float32", "shape": [3], "data": "AAAA"},  # 3 bytes for 12
        {TAG: "tensor", "dtype": "Tensor", "shape": [], "data": ""},  # not a dtype
        {TAG: "tensor", "dtype": "float32", "shape": [1], "data": "not base64!"},
        {TAG: "dict", "items": [[1]]},
        {TAG: "nonsense"},
    ],
)
def test_malformed_state_is_a_checkpoint_error(bad) -> None:
    meta = TrainerMeta(dict, lambda _v: None)
    with pytest.raises(CheckpointError, match=r"state\.x is malformed"):
        meta.check_state_dict({"format": 1, "state": {"x": bad}, "extra": {}})


def test_trainer_meta_round_trip_and_format_check() -> None:
    got: dict = {}
    extra_got: dict = {}
    meta = TrainerMeta(
        lambda: {"w": torch.arange(3)},
        got.update,
        lambda: {"paths": {"p": 4}},
        extra_got.update,
    )
    saved = json.loads(json.dumps(meta.state_dict()))
    meta.load_state_dict(saved)
    assert torch.equal(got["w"], torch.arange(3)) and extra_got == {"paths": {"p": 4}}
    with pytest.raises(CheckpointError, match="format 2, this steadytrain reads 1"):
        meta.check_state_dict({**saved, "format": 2})
