"""Stager: host buffers allocated once and reused across saves; pinned where CUDA is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steadytrain.checkpoint.staging import Stager


def _state(model: nn.Module, step: int) -> dict:
    opt_like = [torch.full((4,), float(step)), (torch.arange(3) + step, "tag")]
    return {"model": model.state_dict(), "optim": opt_like, "step": step}


def _ptrs(snapshot: dict) -> list[int]:
    model = [t.data_ptr() for t in snapshot["model"].values()]
    return [*model, snapshot["optim"][0].data_ptr(), snapshot["optim"][1][0].data_ptr()]


def test_buffers_are_reused_across_saves_and_hold_each_saves_values():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    stager = Stager()
    first = stager.stage(_state(model, 1))
    ptrs, allocated = _ptrs(first), stager.allocations
    assert allocated == 6  # 4 parameters + 2 optimizer-like tensors
    for step in (2, 3, 4):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        snap = stager.stage(_state(model, step))
        assert _ptrs(snap) == ptrs, "the same host memory, save after save"
        assert stager.allocations == allocated, "no allocation once shapes are known"
        assert torch.equal(snap["model"]["0.weight"], model[0].weight)  # this save's values
        assert snap["optim"][0][0].item() == step and snap["optim"][1][1] == "tag"
        assert snap["step"] == step


def test_a_changed_shape_or_dtype_reallocates_only_that_buffer():
    stager = Stager()
    a = stager.stage({"w": torch.zeros(4), "b": torch.zeros(2)})
    b = stager.stage({"w": torch.zeros(5), "b": torch.ones(2)})
    assert b["w"].data_ptr() != a["w"].data_ptr() and b["b"].data_ptr() == a["b"].data_ptr()
    c = stager.stage({"w": torch.zeros(5, dtype=torch.float64), "b": torch.ones(2)})
    assert c["w"].dtype == torch.float64 and stager.allocations == 4
    stager.release()
    stager.stage({"w": torch.zeros(5, dtype=torch.float64), "b": torch.ones(2)})
    assert stager.allocations == 6  # release() dropped them: allocated again


def test_pinning_follows_cuda_and_refuses_what_cannot_work(monkeypatch):
    assert Stager().pin_memory is torch.cuda.is_available()
    assert Stager(shared_memory=True).pin_memory is False
    with pytest.raises(ValueError, match="async_mode='thread'"):
        Stager(shared_memory=True, pin_memory=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Stager().pin_memory is False
    with pytest.raises(ValueError, match=r"needs CUDA.*leave pin_memory unset"):
        Stager(pin_memory=True)
    snap = Stager().stage({"w": torch.ones(3)})
    assert not snap["w"].is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers need CUDA")
def test_cuda_state_stages_into_pinned_reused_buffers():
    stager = Stager()
    src = {"w": torch.randn(1 << 16, device="cuda"), "b": torch.randn(7, device="cuda")}
    first = stager.stage(src)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in first.values())
    src["w"].add_(1.0)
    second = stager.stage(src)  # async copies: stage() must have waited for them
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.equal(second["w"], src["w"].cpu()) and torch.equal(second["b"], src["b"].cpu())
