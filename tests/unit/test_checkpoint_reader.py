"""The verifying DCP reader: checks before serving, one-pass streaming, fast path, fallbacks.

Single process, real DCP files (the multi-rank agreement runs in tests/distributed/).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.hashing_writer import CheckpointWriter
from steadytrain.checkpoint.reader import VerifyingReader, read_verified
from steadytrain.checkpoint.writer import Group
from steadytrain.errors import CheckpointError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(300, 7, generator=g),
        "bf16": torch.randn(64, generator=g).to(torch.bfloat16),
        "i64": torch.arange(1000),
        "scalar": torch.tensor(2.5),
        "flag": torch.tensor([True, False, True]),
        "transposed": torch.randn(5, 9, generator=g).t(),  # saved non-contiguous
        "view": torch.arange(40.0)[10:30],  # saved with a storage offset
    }


def _save(directory: str, tensors: dict, threads: int = 1, fmt: str = "torch_save") -> dict:
    """A DCP checkpoint plus the COMMIT-style manifest of its files. ``fmt``: DCP's own
    writer's ``torch.save`` archives, or our writer's raw records."""
    if fmt == "raw":
        writer = CheckpointWriter(directory, tensor_format="raw")
    else:
        writer = dcp.FileSystemWriter(directory, thread_count=threads)
    dcp.save({"s": tensors}, storage_writer=writer, no_dist=True)
    files = [C.file_entry(directory, n, 0) for n in sorted(os.listdir(directory))]
    return {"files": files}


def _load(directory: str, manifest: dict, verify: str, template: dict) -> VerifyingReader:
    meta = next(f for f in manifest["files"] if f["path"] == ".metadata")
    reader = VerifyingReader(directory, manifest, read_verified(directory, meta), Group(), verify)
    dcp.load({"s": template}, storage_reader=reader, no_dist=True)
    return reader


def _zeros_like(tensors: dict) -> dict:
    return {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("fmt", ["torch_save", "raw"])
@pytest.mark.parametrize("verify", ["before", "stream", "none"])
def test_every_dtype_and_layout_loads_bit_identically(tmp_path, verify, fmt):
    src = _tensors()
    manifest = _save(str(tmp_path), src, fmt=fmt)
    dst = _zeros_like(src)
    reader = _load(str(tmp_path), manifest, verify, dst)
    for k, v in src.items():
        assert torch.equal(dst[k], v), k
    assert reader.error is None and reader.touched
    if fmt == "torch_save":  # straight into place, but DCP's path for the transposed one
        assert reader.fast_items >= 6 and reader.slow_items >= 1
    else:  # a raw record is written C-ordered: every one goes straight into place
        assert (reader.fast_items, reader.slow_items) == (len(src), 0)


@pytest.mark.parametrize("fmt", ["torch_save", "raw"])
def test_fast_path_writes_into_the_live_tensor_memory(tmp_path, fmt):
    src = {"w": torch.randn(1024)}
    manifest = _save(str(tmp_path), src, fmt=fmt)
    live = torch.zeros(1024)
    ptr = live.data_ptr()
    reader = _load(str(tmp_path), manifest, "before", {"w": live})
    assert live.data_ptr() == ptr and torch.equal(live, src["w"])
    assert reader.fast_items == 1 and reader.slow_items == 0


def _data_offset(directory: str) -> tuple[str, int]:
    """A shard file and an offset inside tensor bytes (past the archive's headers)."""
    shard = next(n for n in os.listdir(directory) if n.endswith(".distcp"))
    return os.path.join(directory, shard), os.path.getsize(os.path.join(directory, shard)) // 2


@pytest.mark.parametrize("fmt", ["torch_save", "raw"])
def test_before_mode_refuses_a_damaged_shard_without_touching_live_state(tmp_path, fmt):
    src = {"w": torch.randn(4096)}
    manifest = _save(str(tmp_path), src, fmt=fmt)
    _flip(*_data_offset(str(tmp_path)))
    live = torch.full((4096,), 7.0)
    meta = next(f for f in manifest["files"] if f["path"] == ".metadata")
    reader = VerifyingReader(
        str(tmp_path), manifest, read_verified(str(tmp_path), meta), Group(), "before"
    )
    with pytest.raises(BaseException, match="checksum"):
        dcp.load({"s": {"w": live}}, storage_reader=reader, no_dist=True)
    assert not reader.touched and "checksum" in reader.error
    assert torch.all(live == 7.0), "nothing may be written before the checksum matched"


@pytest.mark.parametrize("fmt", ["torch_save", "raw"])
def test_stream_mode_reads_once_and_still_reports_the_damage(tmp_path, fmt):
    src = {"w": torch.randn(4096)}
    manifest = _save(str(tmp_path), src, fmt=fmt)
    _flip(*_data_offset(str(tmp_path)))
    meta = next(f for f in manifest["files"] if f["path"] == ".metadata")
    reader = VerifyingReader(
        str(tmp_path), manifest, read_verified(str(tmp_path), meta), Group(), "stream"
    )
    with pytest.raises(BaseException, match="checksum"):
        dcp.load({"s": {"w": torch.zeros(4096)}}, storage_reader=reader, no_dist=True)
    assert reader.touched and "checksum" in reader.error


def test_a_damaged_file_no_rank_reads_still_fails_verification(tmp_path):
    src = {f"t{i}": torch.randn(2048) for i in range(6)}
    manifest = _save(str(tmp_path), src, threads=2)  # two shard files
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert len(shards) == 2
    # Load only tensors that live in the first file, damage the second one.
    meta = next(f for f in manifest["files"] if f["path"] == ".metadata")
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    in_first = sorted(
        {i.fqn.split(".", 1)[1] for i, s in md.storage_data.items() if s.relative_path == shards[0]}
    )
    _flip(str(tmp_path / shards[1]), os.path.getsize(tmp_path / shards[1]) // 2)
    template = {k: torch.zeros(2048) for k in in_first}
    reader = VerifyingReader(
        str(tmp_path), manifest, read_verified(str(tmp_path), meta), Group(), "before"
    )
    with pytest.raises(BaseException, match="checksum"):
        dcp.load({"s": template}, storage_reader=reader, no_dist=True)
    assert shards[1] in reader.error and not reader.touched


def test_metadata_is_unpickled_from_the_verified_bytes_only(tmp_path):
    src = {"w": torch.randn(16)}
    manifest = _save(str(tmp_path), src)
    meta = next(f for f in manifest["files"] if f["path"] == ".metadata")
    blob = read_verified(str(tmp_path), meta)
    os.remove(tmp_path / ".metadata")  # DCP must not need the file again
    dst = {"w": torch.zeros(16)}
    dcp.load(
        {"s": dst},
        storage_reader=VerifyingReader(str(tmp_path), manifest, blob, Group(), "before"),
        no_dist=True,
    )
    assert torch.equal(dst["w"], src["w"])
    (tmp_path / ".metadata").write_bytes(blob[:-1])
    with pytest.raises(CheckpointError, match="bytes, COMMIT says"):
        read_verified(str(tmp_path), meta)


@pytest.mark.parametrize("verify", ["full", "overlap"])
def test_checkpointer_restores_model_and_optimizer_exactly(tmp_path, verify):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    ckpt = Checkpointer(str(tmp_path), async_mode="sync")
    ckpt.save(1, {"model": model, "optim": opt})
    ckpt.close()
    want_m = {k: v.clone() for k, v in model.state_dict().items()}
    want_o = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    for s in opt.state.values():
        for t in s.values():
            t.fill_(-1.0)
    assert Checkpointer(str(tmp_path), verify=verify).restore_latest({"model": model, "optim": opt})
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_m[k]), k
    for k, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, want_o[k][n]), (k, n)
