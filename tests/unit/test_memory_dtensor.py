"""The memory tier's file keeps a sharded ``DTensor`` (FSDP2, tensor parallel) as its local
part and gives it back on the live layout, or refuses it for another one (one process, a
one-rank gloo group; tests/distributed/test_memory_tier.py restores FSDP2 across nodes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from steadytrain.checkpoint.memory import snapshot as snap
from steadytrain.checkpoint.memory.restored import tensors_of as _tensors
from steadytrain.errors import CheckpointError


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_tree(mesh) -> dict:
    torch.manual_seed(3)
    w = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(4), mesh, [Replicate()])
    state = {"w": {"exp_avg": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])}}
    return {"m": {"w": w, "b": b}, "o": {"state": state, "step": torch.tensor(3.0)}}


def test_a_dtensor_round_trips_onto_the_live_layout_bit_exact(mesh, tmp_path):
    tree = sharded_tree(mesh)
    path = str(tmp_path / "step.snap")
    snap.write_file(path, snap.build({"job": "j", "step": 3}, tree))
    _, got = snap.parse(snap.read_file(path), path)
    assert isinstance(got["m"]["w"], snap.LocalShard) and snap.has_shards(got)
    assert got["m"]["w"].placements == ("Shard(dim=0)",)
    placed = snap.place_shards(got, sharded_tree(mesh))
    for key in ("w", "b"):
        assert isinstance(placed["m"][key], DTensor)
        assert placed["m"][key].placements == tree["m"][key].placements
        assert torch.equal(placed["m"][key].to_local(), tree["m"][key].to_local())
    exp_avg = placed["o"]["state"]["w"]["exp_avg"]
    assert torch.equal(exp_avg.to_local(), tree["o"]["state"]["w"]["exp_avg"].to_local())
    assert torch.equal(placed["o"]["step"], torch.tensor(3.0))  # plain tensors stay plain
    # the pages a kept DTensor lies on are those of its local part
    assert {t.data_ptr() for t in _tensors(placed["m"])} == {
        placed["m"][k].to_local().data_ptr() for k in ("w", "b")
    }


def test_a_shard_on_another_layout_is_refused_naming_the_state(mesh):
    tree = sharded_tree(mesh)
    _, got = snap.parse(snap.build({}, tree), "x")
    replicated = sharded_tree(mesh)
    replicated["m"]["w"] = distribute_tensor(torch.randn(6, 4), mesh, [Replicate()])
    with pytest.raises(CheckpointError, match=r"state <state>\.m\.w: .*Shard\(dim=0\).*Replicate"):
        snap.place_shards(got, replicated)
    plain = sharded_tree(mesh)
    plain["m"]["w"] = torch.randn(6, 4)
    with pytest.raises(CheckpointError, match=r"<state>\.m\.w: .*is not sharded.*durable"):
        snap.place_shards(got, plain)
    reshaped = sharded_tree(mesh)
    reshaped["m"]["w"] = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with pytest.raises(CheckpointError, match="another layout"):
        snap.place_shards(got, reshaped)


def test_a_damaged_shard_entry_is_refused_naming_the_file(mesh, tmp_path):
    """A header whose checksum holds but whose ``__dtensor__`` entry is not ours (a shape
    that is not a list of ints) is a ``CheckpointError`` naming the file, not a crash."""
    import numpy as np

    plan = snap.layout({"job": "j", "step": 3}, sharded_tree(mesh))
    entry = plan.header["tree"]["m"]["w"]["__dtensor__"]
    entry[1] = "x"  # the global shape; the header gets shorter, so it still fits
    path = str(tmp_path / "step.snap")
    snap.write_file(path, snap.fill(plan, np.empty(plan.total, np.uint8)))
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        snap.parse(snap.read_file(path), path)
