"""``Recovery``'s snapshots copied beside the step (steadytrain.inplace.snapshot): the
optimizer's step waits for the copy of what it changes, what the forward may change is
copied at once, and a copy that failed is never a snapshot. One process, a real TCPStore
as torchrun's shared store (the per-rank states go there)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed as dist

from steadytrain.inplace import Recovery

_real_foreach_copy = torch._foreach_copy_


def turn_on(monkeypatch) -> dist.TCPStore:
    """In-place recovery on, as the keeper turns it on, with a store to write to."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("STEADYTRAIN_INPLACE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("STEADYTRAIN_INPLACE_FD", raising=False)
    return store


@pytest.fixture
def enabled(monkeypatch):
    yield turn_on(monkeypatch)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optim)
    return model, optim


def step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 64)).square().mean().backward()  # BatchNorm's buffers change here
    optim.step()
    optim.zero_grad()


def live(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone(v) for v in tree)
    return tree


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_optimizer_step_waits_for_a_slow_background_copy(enabled, monkeypatch) -> None:
    """The copy of the parameters and moments is held back until the step has run its
    forward and backward; ``optim.step()`` must wait for it, or the snapshot would hold
    the step's result instead of its start."""
    model, optim = trained()
    release, copying = threading.Event(), []

    def slow_copy(dst, src):
        copying.append(threading.current_thread().name)
        assert release.wait(60), "the test never released the copy"
        _real_foreach_copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", slow_copy)
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=1)
    before = clone(live(model, optim))
    recovery._before(0)  # the start of step 0: the copy is under way, not done
    assert copying == ["steadytrain-snapshot"] and 0 not in recovery._snaps
    model(torch.randn(16, 64)).square().mean().backward()
    assert equal(
        recovery._writing.tree["model"]["1.running_mean"], before["model"]["1.running_mean"]
    )
    threading.Timer(0.5, release.set).start()  # optim.step() must wait out this half second
    optim.step()
    assert 0 in recovery._snaps and recovery._writing is None
    snap = recovery._snaps[0][0]
    assert equal(snap, before), "the snapshot is not the state at the start of the step"
    assert not equal(snap["model"], live(model, optim)["model"])  # the step did train
    recovery.close()


def test_what_the_forward_changes_is_copied_before_the_step_runs(enabled, monkeypatch) -> None:
    """A module's buffers are no optimizer's: the forward changes them (BatchNorm, DDP's
    buffer broadcast), so they are copied when the snapshot starts, not in the background."""
    model, optim = trained()
    release = threading.Event()

    def held_copy(dst, src):
        assert release.wait(60)
        _real_foreach_copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", held_copy)
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=1)
    mean = model[1].running_mean.clone()
    recovery._before(0)
    model(torch.randn(16, 64))  # changes running_mean while the background copy waits
    assert not torch.equal(model[1].running_mean, mean)
    release.set()
    recovery._settle()
    assert torch.equal(recovery._snaps[0][0]["model"]["1.running_mean"], mean)
    recovery.close()


def test_a_copy_that_fails_is_never_a_snapshot(enabled, monkeypatch, caplog) -> None:
    model, optim = trained()
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=1)
    recovery._before(0)
    step(model, optim)
    recovery._before(1)
    step(model, optim)
    assert sorted(recovery._snaps) == [0, 1]
    kept = clone(recovery._snaps[1][0])

    def failing(dst, src):
        _real_foreach_copy(dst[: len(dst) // 2], src[: len(src) // 2])  # torn half-way
        raise RuntimeError("copy failed half-way")

    monkeypatch.setattr(torch, "_foreach_copy_", failing)
    with caplog.at_level(logging.WARNING, logger="steadytrain.inplace"):
        recovery._before(2)  # evicts step 0's tensors, then fails to fill them
        step(model, optim)
    assert sorted(recovery._snaps) == [1], "a torn snapshot became a rollback point"
    assert equal(recovery._snaps[1][0], kept)  # the complete one is untouched
    assert "the snapshot of step 2 failed to copy" in caplog.text
    recovery.close()


@pytest.mark.parametrize("background", [True, False])
def test_each_way_takes_the_same_snapshot(enabled, background: bool) -> None:
    model, optim = trained()
    recovery = Recovery(
        replicated={"model": model, "optim": optim}, every_steps=2, background=background
    )
    want = {}
    for s in range(5):
        if s % 2 == 0:
            want[s] = clone(live(model, optim))
        recovery._before(s)
        step(model, optim)
    recovery._settle()
    assert sorted(recovery._snaps) == [2, 4]
    assert all(equal(recovery._snaps[s][0], want[s]) for s in (2, 4))
    assert recovery.background is background
    recovery.close()


class Sub(torch.Tensor):
    """A tensor subclass, as FSDP2's DTensor is one (which has no data pointer of its own)."""


def test_only_plain_tensors_and_parameters_are_copied_in_the_background() -> None:
    from steadytrain.inplace.snapshot import deferrable

    plain = torch.nn.Parameter(torch.randn(4))
    sub = torch.nn.Parameter(torch.randn(4).as_subclass(Sub))
    assert type(sub) is Sub  # a subclass stays one inside a Parameter
    optim = torch.optim.SGD([plain, sub], lr=0.1)
    assert deferrable([optim]) == {plain.data_ptr()}
