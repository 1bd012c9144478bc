"""``Recovery``'s live recovery point (steadytrain.inplace.live): the start of the step being
run, held by the live model and optimizer until the optimizer steps; the per-rank states in
torchrun's store under a bounded set of keys; a survivor's restore from it. One process, a
real TCPStore as torchrun's shared store, a real gloo group of one for the restore (the
regroup of real processes: tests/integrations/test_inplace.py)."""

from __future__ import annotations

import datetime
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist

from steadytrain.inplace import Recovery
from steadytrain.inplace.regroup import InPlaceFallback, Report, agree

sys.path.insert(0, os.path.dirname(__file__))

from test_inplace_snapshot import clone, equal, live, step, trained, turn_on  # noqa: E402


@pytest.fixture
def enabled(monkeypatch):
    yield turn_on(monkeypatch)


class Loader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


def with_loader(every: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Loader, Recovery]:
    """A trained model, its optimizer and a loader under a ``Recovery`` (snapshots every
    ``every`` steps)."""
    model, optim = trained()
    loader = Loader()
    replicated = {"model": model, "optim": optim}
    recovery = Recovery(replicated=replicated, per_rank={"loader": loader}, every_steps=every)
    return model, optim, loader, recovery


def forward_backward(model: torch.nn.Module) -> None:
    model(torch.randn(16, 64)).square().mean().backward()  # BatchNorm's buffers change here


@pytest.mark.parametrize("every", [0, 2])
def test_the_store_holds_a_bounded_set_of_keys_however_long_the_run(enabled, every: int) -> None:
    """Every step puts this rank's per-rank state in the store (and every snapshot too):
    after 40 steps the store holds exactly the keys it held after 4, the two newest of each
    kind, which read back as this rank's states of those steps."""
    model, optim, loader, recovery = with_loader(every)
    counts = {}
    for s in range(40):
        recovery._before(s)
        loader.position += 1
        step(model, optim)
        counts[s] = enabled.num_keys()
    assert counts[39] == counts[3], counts  # not one more key per step or per snapshot
    lives, ahead = recovery._slots.read("live")
    # 40: the optimizer's pre-hook of step 39 published the state of 40 (in 38's slot); 39's,
    # published the same way and proven at its start, was not written again
    assert {s: own["loader"]["position"] for s, own in lives.items()} == {39: 39, 40: 40}
    assert ahead == (39, 40)
    snaps, _ = recovery._slots.read("snap")
    assert sorted(snaps) == ([] if every == 0 else [36, 38])
    assert sorted(recovery._snaps) == ([] if every == 0 else [36, 38])
    recovery.close()


def test_the_start_of_the_step_is_live_until_the_optimizer_steps(enabled) -> None:
    """After ``_before(s)`` the forward and backward change neither the parameters nor the
    optimizer's state: the live point is the start of ``s``, with no copy of them (the
    tree holds the live tensors); the buffers the forward changes were copied. The
    optimizer's ``step()`` ends it."""
    model, optim = trained()
    recovery = Recovery(replicated={"model": model, "optim": optim}, every_steps=0)
    start = clone(live(model, optim))
    recovery._before(5)
    forward_backward(model)
    assert recovery._live_step() == 5
    tree = recovery._live.tree
    assert equal(tree, start), "the live point is not the state at the start of the step"
    assert tree["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()  # not a copy
    assert not torch.equal(model[1].running_mean, start["model"]["1.running_mean"])
    optim.step()
    assert recovery._live_step() is None  # the optimizer stepped: no longer the start of 5
    recovery._before(6)
    assert recovery._live_step() == 6
    assert recovery._snaps == {}  # every_steps=0: no snapshot at all
    recovery.close()


def test_a_survivor_resumes_the_failed_step_from_its_live_state(enabled) -> None:
    """The survivor's side of a live regroup (``_restore``, a gloo group of one, so it is
    its own source): the failed step's forward and backward and the loader's and
    generators' moves are undone, the model and optimizer are the start of the step, the
    gradients are gone, and no snapshot was ever taken."""
    model, optim, loader, recovery = with_loader()
    loader.position = 7
    recovery._before(7)
    start = clone(live(model, optim))
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    loader.position += 1
    forward_backward(model)  # ... and then a peer is lost in the gradient all-reduce
    random.random()
    prefix = dist.PrefixStore("live-test/", enabled)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=prefix, rank=0, world_size=1, timeout=timeout)
    try:
        recovery._restore(7, 0, True, None, {})
    finally:
        dist.destroy_process_group()
    assert equal(live(model, optim), start)
    assert loader.position == 7 and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == py_rng
    assert recovery._snaps == {} and recovery._live is None
    step(model, optim)  # and it trains on
    recovery.close()


def test_the_optimizer_step_publishes_the_next_steps_state_and_the_next_step_proves_it(
    enabled,
) -> None:
    """At the optimizer's step pre-hook of step 5 (the gradient all-reduce is done) the
    store already holds this rank's per-rank state of step 6, marked ``ahead``, equal to
    what the start of 6 holds: a rank lost in its optimizer.step() or the loop's tail leaves
    its state of the step its peers reach. The start of 6 finds the same bytes, writes
    nothing more and proves the publication (what its regroup report says)."""
    model, optim, loader, recovery = with_loader()
    loader.position = 5
    recovery._before(5)
    loader.position += 1  # the step's batch
    forward_backward(model)
    torch_rng = torch.get_rng_state()
    optim.step()  # ... and the rank dies in it, or after it
    lives, ahead = recovery._slots.read("live")
    assert sorted(lives) == [5, 6] and ahead == (6,)
    assert lives[6]["loader"] == {"position": 6}
    assert torch.equal(lives[6]["__steadytrain_rng__"][0], torch_rng)
    optim.zero_grad()
    key = recovery._slots.key("live", 6)
    published = enabled.get(key)
    recovery._before(6)
    assert enabled.get(key) == published  # the same record: not written again
    assert recovery._ahead.proven(6) and recovery._ahead.broken is None
    recovery.close()


def test_a_loop_that_draws_after_the_optimizer_step_voids_the_published_state(enabled) -> None:
    """A loop that draws a random number after optimizer.step(): the state the pre-hook
    published for step 6 is not the rank's state of 6. The start of 6 sees it, writes the
    true one and marks the publication void on this rank for good: its report says not
    proven, so a replaced rank's ``ahead`` state is not used (the snapshot, else the whole
    restart), and later pre-hooks publish nothing."""
    model, optim, loader, recovery = with_loader()
    recovery._before(5)
    forward_backward(model)
    optim.step()
    random.random()  # after optimizer.step(): the generators' state of 6 changed
    optim.zero_grad()
    recovery._before(6)
    lives, ahead = recovery._slots.read("live")
    assert ahead == () and lives[6]["__steadytrain_rng__"][1][1].tolist() == list(
        random.getstate()[1]
    )  # the true state of 6 replaced the one published ahead
    assert recovery._ahead.broken == 6 and not recovery._ahead.proven(6)
    survivor = Report(0, (), False, recovery._live_step(), proven=recovery._ahead.proven(6))
    replaced = Report(1, (), True, None, (5, 6), ahead=(6,))  # its publication of 6 stood
    with pytest.raises(InPlaceFallback, match=r"survivor\(s\) \[0\] did not prove"):
        agree([survivor, replaced])
    forward_backward(model)
    optim.step()  # void for good: nothing published ahead any more
    assert sorted(recovery._slots.read("live")[0]) == [5, 6]
    recovery.close()
