"""Raw tensor records (checkpoint/raw_records.py): what the default writer puts in a shard
file, how every steadytrain reader and a plain ``dcp.load`` with ``ShardReader`` read it
back, what DCP's stock reader says about it, and the errors for damaged records."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.checkpoint.hashing_writer import CheckpointWriter
from steadytrain.checkpoint.raw_records import TAG, ShardReader, meta_tensor, raw_layout
from steadytrain.checkpoint.torch_private import storage_infos
from steadytrain.errors import CheckpointError, ConfigError


class Tensors:
    """A stateful holding named tensors (what a Checkpointer saves and restores)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def _every_kind() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 10, generator=g)
    return {
        "f32": torch.randn(33, 5, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 4, generator=g).half(),
        "f64": torch.randn(3, generator=g).double(),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(-50, 50),
        "u8": torch.arange(256, dtype=torch.uint8),
        "flags": torch.tensor([True, False, True, True]),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),  # not contiguous: written C-ordered
        "offset_view": base[2:5, 3:],  # a view into a larger storage
    }


def _infos(step_dir: str) -> dict:
    reader = dcp.FileSystemReader(step_dir)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    return dict(storage_infos(reader))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable values of any dtype (float8 has no equality kernel of its own)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_the_default_writer_stores_raw_records_that_restore_bit_exactly(tmp_path, mode):
    src = _every_kind()
    ckpt = Checkpointer(str(tmp_path), async_mode=mode)
    ckpt.save(3, {"t": Tensors(dict(src))})
    ckpt.close()
    assert ckpt.last_event["ok"], ckpt.last_event
    step_dir = str(tmp_path / "step-00000003")
    commit = json.loads(open(os.path.join(step_dir, "COMMIT")).read())
    assert commit["format_version"] == 3 and commit["world"]["tensor_format"] == "raw"
    infos = _infos(step_dir)
    tensor_infos = {i.fqn: md for i, md in infos.items() if i.fqn.startswith("t.")}
    assert len(tensor_infos) == len(src)
    for fqn, md in tensor_infos.items():
        t = src[fqn.removeprefix("t.")]
        assert md.transform_descriptors[0] == TAG, fqn
        assert md.length == t.numel() * t.element_size(), fqn  # the bytes, nothing around
    live = {k: torch.zeros_like(v.contiguous()) for k, v in src.items()}
    assert Checkpointer(str(tmp_path)).restore_latest({"t": Tensors(live)}) == 3
    for k, v in src.items():
        assert live[k].dtype == v.dtype and torch.equal(_bits(live[k]), _bits(v)), k


def test_a_torch_save_checkpoint_still_restores_with_the_raw_default(tmp_path):
    """Checkpoints written before raw records (or with tensor_format="torch_save") load."""
    src = {"w": torch.randn(100), "i": torch.arange(7)}
    ckpt = Checkpointer(str(tmp_path), async_mode="sync", tensor_format="torch_save")
    ckpt.save(1, {"t": Tensors(dict(src))})
    ckpt.close()
    commit = json.loads((tmp_path / "step-00000001" / "COMMIT").read_text())
    assert commit["format_version"] == 2 and commit["world"]["tensor_format"] == "torch_save"
    assert all(
        not md.transform_descriptors for md in _infos(str(tmp_path / "step-00000001")).values()
    )
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    assert Checkpointer(str(tmp_path)).restore_latest({"t": Tensors(live)}) == 1
    assert all(torch.equal(live[k], v) for k, v in src.items())


def _raw_dir(tmp_path, tensors: dict[str, torch.Tensor]) -> str:
    path = str(tmp_path / "ck")
    dcp.save({"s": tensors}, storage_writer=CheckpointWriter(path), no_dist=True)
    return path


def test_dcps_stock_reader_refuses_a_raw_record_and_shard_reader_reads_it(tmp_path):
    src = {"w": torch.randn(64), "b": torch.arange(5)}
    path = _raw_dir(tmp_path, src)
    with pytest.raises(BaseException, match="raw@steadytrain"):  # never a silent misread
        dcp.load({"s": {k: torch.zeros_like(v) for k, v in src.items()}}, checkpoint_id=path)
    out = {k: torch.zeros_like(v) for k, v in src.items()}
    dcp.load({"s": out}, storage_reader=ShardReader(path), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in src.items())


def test_views_are_written_as_the_values_they_show(tmp_path):
    """A lazily negated or conjugated view, or a slice of a larger storage, is written as
    its values in C order (the record holds no storage beyond the tensor's own bytes)."""
    base = torch.randn(6, 10)
    z = torch.randn(4, dtype=torch.complex64)
    src = {"neg": base[1]._neg_view(), "conj": z.conj(), "cols": base[:, 2:4]}
    path = _raw_dir(tmp_path, src)
    by_name = {i.fqn: md for i, md in _infos(path).items()}
    assert by_name["s.cols"].length == 6 * 2 * 4
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in src.items()}
    dcp.load({"s": out}, storage_reader=ShardReader(path), no_dist=True)
    assert torch.equal(out["neg"], -base[1]) and torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["cols"], base[:, 2:4])


def test_shard_reader_converts_a_dtype_as_dcp_does(tmp_path):
    """A destination of another dtype cannot take the bytes as they are: the record is read
    into a tensor of its own dtype, then copied (and converted) into place."""
    src = {"w": torch.randn(50)}
    path = _raw_dir(tmp_path, src)
    out = {"w": torch.zeros(50, dtype=torch.float64)}
    dcp.load({"s": out}, storage_reader=ShardReader(path), no_dist=True)
    assert out["w"].dtype == torch.float64 and torch.equal(out["w"], src["w"].double())


def test_a_quantized_tensor_goes_as_an_archive_in_the_same_file(tmp_path):
    """No byte view (quantized): DCP's torch.save archive, beside raw records."""
    q = torch.quantize_per_tensor(torch.randn(12), 0.05, 3, torch.qint8)
    src = {"q": q, "w": torch.randn(8)}
    path = _raw_dir(tmp_path, src)
    by_name = {i.fqn: md for i, md in _infos(path).items()}
    assert not by_name["s.q"].transform_descriptors
    assert by_name["s.w"].transform_descriptors[0] == TAG
    assert by_name["s.q"].relative_path == by_name["s.w"].relative_path
    out = {
        "q": torch.quantize_per_tensor(torch.zeros(12), 0.05, 3, torch.qint8),
        "w": torch.zeros(8),
    }
    dcp.load({"s": out}, storage_reader=ShardReader(path), no_dist=True)
    assert torch.equal(out["q"].int_repr(), q.int_repr()) and torch.equal(out["w"], src["w"])


def test_descriptors_that_cannot_be_read_here_say_why():
    order = "big" if sys.byteorder == "little" else "little"
    with pytest.raises(CheckpointError, match=f"{order}-endian host"):
        meta_tensor([TAG, "dtype=float32", "shape=4", f"order={order}"], "f.distcp")
    with pytest.raises(CheckpointError, match="upgrade steadytrain"):
        meta_tensor(["raw@steadytrain/2", "dtype=float32", "shape=4"], "f.distcp")
    with pytest.raises(CheckpointError, match="damaged"):
        meta_tensor([TAG, "dtype=notatype", "shape=4", f"order={sys.byteorder}"], "f.distcp")
    with pytest.raises(CheckpointError, match="damaged"):
        meta_tensor([TAG, "dtype=float32", "shape=4,x", f"order={sys.byteorder}"], "f.distcp")
    assert meta_tensor(None) is None and meta_tensor(["zstd/1"]) is None  # not ours
    good = [TAG, "dtype=bfloat16", "shape=2,3", f"order={sys.byteorder}"]
    meta = meta_tensor(good)
    assert meta.dtype == torch.bfloat16 and tuple(meta.shape) == (2, 3)
    md = SimpleNamespace(transform_descriptors=good, offset=64, length=13)  # 12 bytes said
    with pytest.raises(CheckpointError, match=r"f\.distcp: a raw record of 13 bytes"):
        raw_layout(md, "f.distcp")


def test_a_truncated_shard_is_named_when_a_raw_record_runs_past_its_end(tmp_path):
    src = {"w": torch.randn(4096)}
    path = _raw_dir(tmp_path, src)
    shard = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    os.truncate(os.path.join(path, shard), 1000)
    with pytest.raises(BaseException, match=shard):
        dcp.load({"s": {"w": torch.zeros(4096)}}, storage_reader=ShardReader(path), no_dist=True)


def test_an_unknown_tensor_format_is_refused():
    with pytest.raises(ValueError, match="tensor_format"):
        CheckpointWriter("x", tensor_format="safetensors")
    with pytest.raises(ConfigError, match="tensor_format"):
        CheckpointerConfig(tensor_format="safetensors")
