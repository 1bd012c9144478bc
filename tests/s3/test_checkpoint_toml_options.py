"""The ``[checkpoint]`` table reaches a real object store (issue 11, item 6): a training
config's ``remote``, ``storage_options`` (endpoint and credentials, a TOML table) and
``keep_every`` drive the ``Checkpointer`` the loop builds from it, against a real SeaweedFS
server that nothing else in the process points at (no endpoint or key in the environment).
"""

from __future__ import annotations

import json

import pytest
import s3fs
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.train.config import load_config

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

_ENV = (
    "STEADYTRAIN_S3_ENDPOINT",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)


def _states(value: float) -> dict:
    model = nn.Linear(16, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


def test_storage_options_from_toml_reach_the_store(s3_server, s3_bucket, tmp_path, monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    toml = tmp_path / "run.toml"
    toml.write_text(
        f"""
        run_dir = "{tmp_path / "run"}"
        [data]
        dataset = "/unused"
        seq_len = 16
        global_batch = 4
        micro_batch = 2
        [checkpoint]
        every_steps = 1
        keep_last = 2
        keep_every = 2
        async_mode = "sync"
        remote = "{s3_bucket}"
        storage_options = {{endpoint_url = "{s3_server.endpoint}", key = "{s3_server.access_key}", secret = "{s3_server.secret_key}"}}
        """
    )
    cfg = load_config(str(toml))
    events: list[dict] = []
    ckpt = Checkpointer(cfg.checkpoint_dir, on_event=events.append, config=cfg.checkpoint)
    for step in (1, 2, 3, 4, 5):
        ckpt.maybe_save(step, _states(float(step)))
    ckpt.close()
    assert [e["ok"] for e in events] == [True] * 5, events

    # On the server: the newest 2 (4, 5) and the milestone (2) kept by keep_every = 2.
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    prefix = s3_bucket.removeprefix("s3://")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix)) == [
        ".writer-lease",  # the writer lease (docs/checkpoint.md)
        "step-00000002",
        "step-00000004",
        "step-00000005",
    ]
    assert json.loads(fs.cat_file(f"{prefix}/step-00000005/COMMIT"))["step"] == 5

    # A fresh node restores from the remote copy with the same table, and only it.
    states = _states(-1.0)
    other = Checkpointer(str(tmp_path / "node1"), config=cfg.checkpoint)
    assert other.restore_latest(states) == 5
    assert torch.all(states["model"].weight == 5.0)
    other.close()
