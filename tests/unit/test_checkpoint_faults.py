"""Faults during a save: a full disk and a remote store that is down. Training goes on."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs


def _states(width: int, value: float) -> dict:
    model = nn.Linear(width, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (we run as root in CI); skipped where mounting is not allowed."""
    try:
        with tmpfs(tmp_path / "disk", "1M") as mnt:
            yield pathlib.Path(mnt)
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_full_disk_fails_cleanly_and_training_goes_on(tiny_disk, mode):
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tiny_disk), every_steps=1, keep_last=2, async_mode=mode, on_event=events.append
    )
    for step in (1, 2):
        ckpt.maybe_save(step, _states(16, step))  # ~4 KiB each: fits
    ckpt.maybe_save(3, _states(8192, 3.0))  # ~2 MiB: does not fit in 1 MiB
    ckpt.wait()
    assert [e["ok"] for e in events] == [True, True, False]
    assert "No space left" in events[2]["error"] or "ENOSPC" in events[2]["error"]
    assert not any(n.startswith("step-00000003") for n in os.listdir(tiny_disk)), (
        "a failed save must not leave its partial directory filling the disk"
    )
    ckpt.maybe_save(4, _states(16, 4.0))  # the next save retries and succeeds
    ckpt.close()
    assert events[-1]["ok"] and events[-1]["step"] == 4
    states = _states(16, -1.0)
    assert Checkpointer(str(tiny_disk), async_mode="sync").restore_latest(states) == 4
    assert torch.all(states["model"].weight == 4.0)


def test_remote_down_during_upload_then_recovers(tmp_path):
    blocker = tmp_path / "remote"
    blocker.write_text("a file where the bucket should be: every upload fails")
    url = f"file://{blocker}"
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path / "local"),
        every_steps=1,
        async_mode="thread",
        remote=url,
        on_event=events.append,
    )
    ckpt.maybe_save(1, _states(16, 1.0))
    ckpt.wait()
    assert events[0]["ok"] is False and "upload" in events[0]["error"]
    assert not (tmp_path / "local" / "step-00000001" / "COMMIT").exists(), (
        "nothing commits before the upload is verified"
    )
    blocker.unlink()  # the store comes back
    ckpt.maybe_save(2, _states(16, 2.0))
    ckpt.close()
    assert events[-1]["ok"] and events[-1]["path"].startswith(str(blocker))
    assert (blocker / "step-00000002" / "COMMIT").exists()
    # Another node: empty local directory, restores from the remote.
    states = _states(16, -1.0)
    ev: list[dict] = []
    other = Checkpointer(
        str(tmp_path / "other-node"), async_mode="sync", remote=url, on_event=ev.append
    )
    assert other.restore_latest(states) == 2
    assert torch.all(states["model"].weight == 2.0)
    assert ev[-1]["path"].endswith("step-00000002")
    assert not [p for p in os.listdir(tmp_path / "other-node") if p.startswith(".restore")]


def test_remote_partial_upload_is_not_discovered(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    Checkpointer(str(tmp_path / "local"), async_mode="sync", remote=url).save(5, _states(16, 5.0))
    (tmp_path / "remote" / "step-00000006").mkdir()
    (tmp_path / "remote" / "step-00000006" / ".metadata").write_bytes(b"x")
    states = _states(16, -1.0)
    ckpt = Checkpointer(str(tmp_path / "node2"), async_mode="sync", remote=url)
    assert ckpt.restore_latest(states) == 5
