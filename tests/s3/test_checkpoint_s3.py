"""Checkpoints with a real S3 destination (SeaweedFS): staged locally, uploaded in the
background, COMMIT PUT last; restore on a node with an empty local directory; an outage
during the upload fails that save only."""

from __future__ import annotations

import pytest
import s3fs
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def _states(value: float) -> dict:
    model = nn.Linear(32, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


def _opts(server) -> dict:
    opts = dict(server.storage_options)
    # Fail fast while the server is down: the next save retries anyway.
    opts["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2}
    opts["skip_instance_cache"] = True
    return opts


def test_s3_save_commit_last_and_restore_elsewhere(s3_server, s3_bucket, tmp_path):
    opts = _opts(s3_server)
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path / "node0"),
        every_steps=1,
        keep_last=2,
        async_mode="thread",
        remote=s3_bucket,
        storage_options=opts,
        on_event=events.append,
    )
    for step in (1, 2, 3):
        ckpt.maybe_save(step, _states(step))
    ckpt.close()
    assert [e["ok"] for e in events] == [True, True, True], events
    fs = s3fs.S3FileSystem(**opts)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket.removeprefix("s3://")))
    assert names == [".writer-lease", "step-00000002", "step-00000003"], (
        "retention runs on the remote too (and never touches the writer lease)"
    )
    states = _states(-1.0)
    other = Checkpointer(
        str(tmp_path / "node1"), async_mode="sync", remote=s3_bucket, storage_options=opts
    )
    assert other.restore_latest(states) == 3
    assert torch.all(states["model"].weight == 3.0)


def test_s3_outage_during_upload_fails_one_save_only(s3_restartable, tmp_path, monkeypatch):
    server = s3_restartable
    # Uploads retry like every storage request; an outage longer than the retry budget
    # (here 3 s, default 300 s) fails that save, and training goes on.
    monkeypatch.setenv("STEADYTRAIN_STORAGE_RETRY_S", "3")
    opts = _opts(server)
    url = "s3://steady/ckpt"
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path / "local"),
        every_steps=1,
        async_mode="thread",
        remote=url,
        storage_options=opts,
        on_event=events.append,
    )
    ckpt.maybe_save(1, _states(1.0))
    ckpt.wait()
    server.kill()
    ckpt.maybe_save(2, _states(2.0))
    ckpt.wait()
    server.start()
    ckpt.maybe_save(3, _states(3.0))
    ckpt.close()
    assert [(e["step"], e["ok"]) for e in events] == [(1, True), (2, False), (3, True)]
    assert "upload" in events[1]["error"] or "choosing" in events[1]["error"]
    states = _states(-1.0)
    fresh = Checkpointer(
        str(tmp_path / "elsewhere"), async_mode="sync", remote=url, storage_options=opts
    )
    assert fresh.restore_latest(states) == 3
