"""Repeat saves (checkpoint/repeat_save.py): a save whose layout DCP planned before is written
without planning it again, into the same bytes DCP would write; anything that changes the
layout sends the save back to DCP, and nothing is ever left out of a checkpoint."""

from __future__ import annotations

import filecmp
import math
import os
import pathlib

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.repeat_save import _plain_equal, _write_records
from steadytrain.checkpoint.staging import Stager
from steadytrain.storage.publish import digest_bytes
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs


class Extra:
    """A stateful with a tensor and a plain value (a non-tensor DCP record)."""

    def __init__(self, note: str, n: int = 4) -> None:
        self.note, self.t = note, torch.arange(float(n))

    def state_dict(self) -> dict:
        return {"note": self.note, "t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.note = sd["note"]
        self.t = sd["t"].clone()


def _job(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (s + 1))
    return model, optim, sched


def _train(model, optim, sched, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def _checkpoints(events: list[dict]) -> list[tuple[int, str, bool]]:
    return [(e["step"], e["plan"], e["ok"]) for e in events if e["type"] == "checkpoint"]


def _dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:08d}"


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_a_repeat_save_writes_the_bytes_dcp_would_and_restores(tmp_path, mode):
    model, optim, sched = _job()
    extra = Extra("run-a")
    states = {"model": model, "optim": optim, "extra": extra}
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path / "a"), every_steps=1, keep_last=5, async_mode=mode, on_event=events.append
    )
    for step in (1, 2, 3):
        _train(model, optim, sched)  # the LR changes every step: a value record that changes
        ckpt.maybe_save(step, states)
    ckpt.close()
    assert _checkpoints(events) == [(1, "dcp", True), (2, "reused", True), (3, "reused", True)]

    # The same state, saved by a checkpointer that has planned nothing: DCP plans it.
    fresh: list[dict] = []
    with Checkpointer(str(tmp_path / "b"), async_mode="sync", on_event=fresh.append) as other:
        other.save(3, states)
    assert _checkpoints(fresh) == [(3, "dcp", True)]
    reused, planned = _dir(tmp_path / "a", 3), _dir(tmp_path / "b", 3)
    shards = sorted(n for n in os.listdir(planned) if n.startswith("__") or n == ".metadata")
    assert shards == [".metadata", "__0_0.distcp"]
    for name in shards:
        assert filecmp.cmp(reused / name, planned / name, shallow=False), name

    lr = optim.param_groups[0]["lr"]
    model2, optim2, _ = _job(seed=1)
    extra2 = Extra("other")
    states2 = {"model": model2, "optim": optim2, "extra": extra2}
    assert Checkpointer(str(tmp_path / "a"), verify="full").restore_latest(states2) == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert optim2.param_groups[0]["lr"] == lr
    assert optim2.state_dict()["state"][0]["exp_avg"].equal(
        optim.state_dict()["state"][0]["exp_avg"]
    )
    assert extra2.note == "run-a" and torch.equal(extra2.t, extra.t)


def test_every_layout_change_is_planned_again_and_saved_whole(tmp_path):
    model, optim, sched = _job()
    extra = Extra("a")
    # The optimizer without its model: its own state_dict(), which has no AdamW moments
    # before the first step (with the model, DCP's get_optimizer_state_dict creates them).
    states = {"optim": optim, "extra": extra}
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path), every_steps=1, keep_last=10, async_mode="thread", on_event=events.append
    )
    ckpt.save(1, states)
    _train(model, optim, sched)
    ckpt.save(2, states)  # the moments appeared: new keys
    ckpt.save(3, states)
    extra.note = "b" * 500  # a value that pickles to another length (short ones may not:
    # torch.save pads an archive's records to 64 bytes, and an equal length is reused)
    ckpt.save(4, states)
    extra.t = torch.arange(9.0)  # a new shape: the Stager reallocates
    ckpt.save(5, states)
    states["model"] = model  # a new state (and the optimizer's now follows its model)
    states["more"] = Extra("new", 3)
    ckpt.save(6, states)
    ckpt.save(7, states)
    ckpt.close()
    assert [p for _, p, _ in _checkpoints(events)] == [
        "dcp", "dcp", "reused", "dcp", "dcp", "dcp", "reused",
    ]  # fmt: skip
    assert all(ok for _, _, ok in _checkpoints(events))

    model2, optim2, _ = _job(seed=1)
    back = {"model": model2, "optim": optim2, "extra": Extra("x", 9), "more": Extra("y", 3)}
    assert Checkpointer(str(tmp_path), verify="full").restore_latest(back) == 7
    assert back["extra"].note == "b" * 500
    assert torch.equal(back["extra"].t, torch.arange(9.0))
    assert back["more"].note == "new"
    assert torch.equal(optim2.state_dict()["state"][1]["exp_avg_sq"], optim.state[
        list(model.parameters())[1]]["exp_avg_sq"])  # fmt: skip


@pytest.mark.parametrize("setting", [{"tensor_format": "torch_save"}, {"reuse_plans": False}])
def test_dcp_plans_every_save_when_told_or_for_torch_save_archives(tmp_path, setting):
    model, optim, sched = _job()
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path), every_steps=1, async_mode="sync", on_event=events.append, **setting
    )
    _train(model, optim, sched)
    for step in (1, 2):
        ckpt.save(step, {"model": model, "optim": optim})
    ckpt.close()
    assert [p for _, p, _ in _checkpoints(events)] == ["dcp", "dcp"]


def test_a_full_disk_during_a_repeat_save_is_reported_and_keeps_the_last_checkpoint(tmp_path):
    try:
        with tmpfs(tmp_path / "disk", "1M") as mnt:
            disk = pathlib.Path(mnt)
            model = nn.Linear(256, 256)  # ~257 KiB a save: the fourth does not fit in 1 MiB
            events: list[dict] = []
            ckpt = Checkpointer(
                str(disk), every_steps=1, keep_last=10, async_mode="thread",
                on_event=events.append,
            )  # fmt: skip
            for step in (1, 2, 3, 4):
                with torch.no_grad():
                    model.weight.fill_(step)
                ckpt.save(step, {"model": model})
            ckpt.close()
            got = _checkpoints(events)
            assert got[:3] == [(1, "dcp", True), (2, "reused", True), (3, "reused", True)]
            assert got[3][:2] == (4, "reused") and got[3][2] is False
            assert "No space left" in events[-1]["error"], events[-1]["error"]
            assert not (disk / "step-00000004").exists(), "the torn save must be removed"
            back = nn.Linear(256, 256)
            assert Checkpointer(str(disk), verify="full").restore_latest({"model": back}) == 3
            assert torch.all(back.weight == 3.0)
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


def test_the_stager_says_when_the_layout_changed():
    stager = Stager()
    state = {"w": torch.zeros(3), "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}
    stager.stage(state)
    v = stager.layout_version
    state["w"].fill_(1.0)
    state["cfg"]["lr"] = 0.2  # values change, the layout does not
    stager.stage(state)
    assert stager.layout_version == v
    for change in (
        lambda s: s.update(b=torch.ones(2)),  # a key added
        lambda s: s.pop("b"),  # and removed
        lambda s: s.update(w=torch.zeros(4)),  # a new shape
        lambda s: s.update(w=torch.zeros(4, dtype=torch.int64)),  # a new dtype
        lambda s: s["cfg"].update(lr=torch.tensor(0.1)),  # a value became a tensor
        lambda s: s["cfg"].update(betas=[0.9]),  # a tuple became a list
    ):
        change(state)
        stager.stage(state)
        assert stager.layout_version == v + 1, change
        v += 1
        stager.stage(state)
        assert stager.layout_version == v, "the same layout again"


def test_plain_equal_is_pickle_equality_for_plain_values():
    assert _plain_equal(0.1, 0.1) and _plain_equal(math.nan, math.nan)
    assert not _plain_equal(0.0, -0.0)  # == says equal; they pickle differently
    assert not _plain_equal(True, 1) and not _plain_equal(1, 1.0)
    assert _plain_equal({"a": [1, (2.5, "x")], "b": None}, {"a": [1, (2.5, "x")], "b": None})
    assert not _plain_equal({"a": 1, "b": 2}, {"b": 2, "a": 1})  # order is in the pickle
    assert not _plain_equal([1, 2], [1, 2, 3]) and not _plain_equal((1,), [1])
    thing = object()
    assert not _plain_equal(thing, thing)  # not a plain value: serialized again, not trusted


def test_write_records_writes_every_chunk_in_order_past_iov_max(tmp_path):
    g = torch.Generator().manual_seed(3)
    chunks = []
    for i in range(2500):  # more than IOV_MAX (1024) buffers, some empty, some large
        n = 0 if i % 7 == 0 else (1 << 16 if i % 500 == 1 else i % 97)
        chunks.append(
            memoryview(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy())
        )
    chunks.append(b"tail")
    size, digest = _write_records(str(tmp_path / "f"), chunks)
    whole = b"".join(bytes(c) for c in chunks)
    assert (tmp_path / "f").read_bytes() == whole
    assert (size, digest) == (len(whole), digest_bytes(whole))
