"""Checksums taken while DCP writes (checkpoint/hashing_writer.py) and durability before COMMIT.

The COMMIT checksums are no longer computed by reading each file back; these tests hold the
shortcut to what it replaces: every digest equals a fresh read of the file on disk, a stream
that was not written front to back gets no digest (and is then hashed by reading it back),
and every file COMMIT lists was fsync'd before COMMIT was published. The shards' archives
carry no zip CRC-32, yet a torch.save on another thread during the write keeps its CRC.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.hashing_writer import HashingFileSystem, hashing_writer, rank_entries
from steadytrain.checkpoint.raw_records import ShardReader
from steadytrain.storage.publish import file_digest


class Blob:
    def __init__(self, value: float) -> None:
        self.tensors = {f"t{i}": torch.full((1000 + i,), value) for i in range(4)}

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def test_digests_taken_while_writing_match_the_files_on_disk(tmp_path):
    state = {"blob": {f"t{i}": torch.randn(5000 + 7 * i) for i in range(5)}}
    writer, fs = hashing_writer(str(tmp_path / "ck"))
    dcp.save(state, storage_writer=writer, no_dist=True)
    on_disk = sorted(os.listdir(tmp_path / "ck"))
    assert sorted(fs.digests) == on_disk  # the shard and .metadata (followed its rename)
    assert ".metadata" in fs.digests and not any(n.endswith(".tmp") for n in fs.digests)
    for name, (size, digest) in fs.digests.items():
        assert file_digest(str(tmp_path / "ck" / name)) == (size, digest), name
    out = {"blob": {k: torch.empty_like(v) for k, v in state["blob"].items()}}
    dcp.load(out, storage_reader=ShardReader(str(tmp_path / "ck")), no_dist=True)
    assert all(torch.equal(out["blob"][k], v) for k, v in state["blob"].items())


def test_a_stream_that_seeks_gets_no_digest_and_is_read_back(tmp_path):
    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as f:
        f.write(b"x" * 100)
        f.seek(10)
        f.write(b"y")  # overwrites a byte already hashed as "x"
    with fs.create_stream(tmp_path / "b", "wb") as f:
        f.write(b"z" * 100)
    assert set(fs.digests) == {"b"}
    (tmp_path / "__0_0.distcp").write_bytes((tmp_path / "a").read_bytes())
    (entry,) = rank_entries(str(tmp_path), 0, dict(fs.digests))
    assert (entry["size"], entry["xxh3_64"]) == file_digest(str(tmp_path / "a"))


def test_a_file_that_grew_behind_the_stream_gets_no_digest(tmp_path):
    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as f:
        f.write(b"x" * 100)
        f.flush()
        with open(tmp_path / "a", "ab") as other:  # bytes the hasher never saw
            other.write(b"!")
    assert fs.digests == {}


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_commit_checksums_equal_a_fresh_read_and_restore_verifies(tmp_path, mode):
    ckpt = Checkpointer(str(tmp_path), async_mode=mode, verify="full")
    ckpt.save(3, {"blob": Blob(3.0)})
    ckpt.close()
    assert ckpt.last_event["ok"], ckpt.last_event
    step_dir = tmp_path / "step-00000003"
    commit = json.loads((step_dir / "COMMIT").read_text())
    assert {f["path"] for f in commit["files"]} == set(os.listdir(step_dir)) - {"COMMIT"}
    for f in commit["files"]:
        assert file_digest(str(step_dir / f["path"])) == (f["size"], f["xxh3_64"]), f["path"]
    blob = Blob(0.0)
    assert (
        Checkpointer(str(tmp_path), async_mode="sync", verify="full").restore_latest({"blob": blob})
        == 3
    )
    assert all(bool((t == 3.0).all()) for t in blob.tensors.values())


def test_every_file_commit_lists_is_fsynced_before_commit_is_published(tmp_path, monkeypatch):
    """Durable means durable: no listed file may be only in the page cache when COMMIT is."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    ckpt = Checkpointer(str(tmp_path), async_mode="thread")
    ckpt.save(5, {"blob": Blob(5.0)})
    ckpt.close()
    assert ckpt.last_event["ok"], ckpt.last_event
    step_dir = os.path.realpath(tmp_path / "step-00000005")
    commit = json.loads(open(os.path.join(step_dir, "COMMIT")).read())
    commit_at = next(
        i for i, p in enumerate(synced) if os.path.basename(p).startswith(".COMMIT.tmp")
    )
    before = synced[:commit_at]
    for f in commit["files"]:
        path = os.path.join(step_dir, f["path"])
        # DCP fsyncs .metadata under its temporary name, then renames it
        assert path in before or path + ".tmp" in before, (f["path"], synced)
    assert step_dir in synced[commit_at:]  # the directory, after COMMIT's rename
    assert os.path.realpath(tmp_path) in before  # and its name in the root, before COMMIT


def _archive_crcs(step_dir: str) -> set[int]:
    """The zip CRC-32 fields of every tensor archive in a checkpoint's ``.distcp`` files."""
    from steadytrain.checkpoint.torch_private import storage_infos

    reader = dcp.FileSystemReader(step_dir)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    crcs: set[int] = set()
    for info in storage_infos(reader).values():
        with open(os.path.join(step_dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            with zipfile.ZipFile(io.BytesIO(f.read(info.length))) as zf:
                crcs |= {i.CRC for i in zf.infolist()}
    return crcs


def test_shards_are_written_without_zip_crc_and_still_take_the_fast_restore_path(tmp_path):
    """tensor_format="torch_save": no zip CRC-32 in our shards (COMMIT's xxh3 covers them), and archive.py still parses
    every tensor's layout from them: restore keeps its single-pass path."""
    from steadytrain.checkpoint.archive import tensor_layout
    from steadytrain.checkpoint.torch_private import storage_infos

    assert torch.serialization.get_crc32_options()
    ckpt = Checkpointer(str(tmp_path), async_mode="thread", tensor_format="torch_save")
    ckpt.save(2, {"blob": Blob(2.0)})
    ckpt.close()
    assert torch.serialization.get_crc32_options()  # the caller's setting is back
    step_dir = str(tmp_path / "step-00000002")
    reader = dcp.FileSystemReader(step_dir)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    infos = storage_infos(reader)
    assert len(infos) == 4
    for info in infos.values():
        fd = os.open(os.path.join(step_dir, info.relative_path), os.O_RDONLY)
        try:
            with open(os.path.join(step_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                with zipfile.ZipFile(io.BytesIO(f.read(info.length))) as zf:
                    assert {i.CRC for i in zf.infolist()} == {0}
            found = tensor_layout(fd, info.offset, info.length)
        finally:
            os.close(fd)
        assert found is not None
        meta, _ = found
        assert meta.dtype == torch.float32 and meta.numel() in (1000, 1001, 1002, 1003)


def test_a_torch_save_on_another_thread_during_a_checkpoint_write_keeps_its_crc(
    tmp_path, monkeypatch
):
    """The CRC is off in the checkpoint's writing thread only: the training thread's own
    torch.save, made while the shards are being written, still carries real CRC-32s."""
    import contextlib
    import threading

    writing, saved = threading.Event(), threading.Event()
    original = HashingFileSystem.create_stream

    @contextlib.contextmanager
    def pausing(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            writing.set()  # inside DCP's write_data, where the CRC is off
            saved.wait(30)
        with original(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(HashingFileSystem, "create_stream", pausing)
    ckpt = Checkpointer(str(tmp_path), async_mode="thread", tensor_format="torch_save")
    ckpt.save(4, {"blob": Blob(4.0)})
    assert writing.wait(30), "the writer thread never reached DCP's write"
    buf = io.BytesIO()
    torch.save(torch.arange(1000.0), buf)
    saved.set()
    ckpt.close()
    assert ckpt.last_event["ok"], ckpt.last_event
    with zipfile.ZipFile(buf) as zf:
        crcs = [i.CRC for i in zf.infolist() if i.file_size]
        assert crcs and 0 not in crcs
        assert zf.testzip() is None  # and they are the right ones
    assert _archive_crcs(str(tmp_path / "step-00000004")) == {0}  # written in that window
