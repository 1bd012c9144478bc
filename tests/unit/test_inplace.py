"""The pure parts of in-place recovery: the keeper's policy, the agreed step, the preload list,
and which errors count as a lost peer (the real processes: tests/integrations/test_inplace.py)."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist

from steadytrain.inplace.keeper import imports_of
from steadytrain.inplace.policy import Death, Policy
from steadytrain.inplace.regroup import InPlaceFallback, Report, agree, is_peer_loss

KILL = -signal.SIGKILL


def test_a_signal_death_after_a_step_is_recovered_until_the_limit() -> None:
    policy = Policy(max_recoveries=2)
    assert policy.verdict(Death(KILL, stepped=True), recovered=0) is None
    assert policy.verdict(Death(-signal.SIGSEGV, stepped=True), recovered=1) is None
    assert "2 in-place recoveries already" in policy.verdict(Death(KILL, True), recovered=2)


@pytest.mark.parametrize(
    "death, why",
    [
        (Death(1, stepped=True), "exited with status 1 (its own verdict"),
        (Death(0, stepped=True), "exited with status 0"),
        (Death(-signal.SIGTERM, stepped=True), "SIGTERM, not a process fault"),
        (Death(KILL, stepped=False), "before it completed a step"),
    ],
)
def test_everything_else_goes_to_the_whole_restart(death: Death, why: str) -> None:
    assert why in Policy(max_recoveries=5).verdict(death, recovered=0)


def test_max_recoveries_zero_turns_it_off_and_a_negative_one_is_refused() -> None:
    assert "0 in-place recoveries already" in Policy(0).verdict(Death(KILL, True), 0)
    with pytest.raises(ValueError, match="max_recoveries must be >= 0"):
        Policy(-1)


def test_the_step_is_the_newest_every_rank_holds_and_a_survivor_sends() -> None:
    reports = [Report(0, (3, 6), False), Report(1, (3,), True), Report(2, (3, 6), False)]
    assert agree(reports) == (3, 0)
    reports = [Report(0, (6, 9), True), Report(1, (6, 9), False), Report(2, (6, 9), False)]
    assert agree(reports) == (9, 1)


def test_no_common_step_or_no_survivor_falls_back() -> None:
    with pytest.raises(InPlaceFallback, match=r"rank 0: \[6\]; rank 1: \[3\]"):
        agree([Report(0, (6,), False), Report(1, (3,), True)])
    with pytest.raises(InPlaceFallback, match="every rank is a replacement"):
        agree([Report(0, (6,), True), Report(1, (6,), True)])


def test_the_preload_list_is_the_scripts_top_level_absolute_imports(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch.nn as nn\nfrom numpy import zeros\nfrom . import sibling\n"
        "if True:\n    import json\n\ndef f():\n    import csv\nimport os\n"
    )
    assert imports_of(str(script)) == ["os", "torch.nn", "numpy"]


def test_only_a_lost_peer_is_recovered() -> None:
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8580. This is")
    assert is_peer_loss(gloo)
    assert is_peer_loss(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert is_peer_loss(dist.DistNetworkError("x"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("Connection closed by peer"))


def test_a_thread_an_import_started_is_named_before_the_keeper_forks() -> None:
    import threading

    from steadytrain.inplace.keeper import foreign_threads

    before = foreign_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="started-by-an-import")
    t.start()
    try:
        assert foreign_threads() == [*before, "started-by-an-import"]
    finally:
        stop.set()
        t.join()


def test_a_snapshot_copies_into_the_evicted_one_and_never_aliases_the_live_state() -> None:
    import torch

    from steadytrain.inplace.recovery import copy_state

    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    live = {"model": model.state_dict(), "optim": optim.state_dict()}
    first = copy_state(live)
    weight = first["model"]["weight"]
    assert torch.equal(weight, model.weight) and weight.data_ptr() != model.weight.data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the snapshot does not move with it
    assert not torch.equal(first["model"]["weight"], model.weight)
    second = copy_state({"model": model.state_dict(), "optim": optim.state_dict()}, first)
    assert second["model"]["weight"].data_ptr() == weight.data_ptr()  # reused, not allocated
    assert torch.equal(second["model"]["weight"], model.weight)
    assert second["optim"]["param_groups"] == optim.state_dict()["param_groups"]
    grown = copy_state({"model": torch.nn.Linear(4, 5).state_dict()}, second)
    assert grown["model"]["weight"].shape == (5, 4)  # another shape: a fresh tensor
