"""A remote checkpoint is downloaded, once per node, into ``LOCAL_ROOT/.restore-NAME-rankL-PID``
(L: the node's lowest rank; here the one rank) and verified there. What a failed download leaves (a damaged remote file, a full local
disk, a process killed mid-download) never stays behind in the local root: each failed
attempt would otherwise keep up to a checkpoint's size there until the disk fills. A
damaged checkpoint is passed over for an older one; one that cannot be downloaded (a full
local disk) stops the restore naming the file and the fix: it is not known to be damaged,
and neither an older one nor a fresh start may silently take its place."""

from __future__ import annotations

import os
import subprocess

import pytest
import s3fs
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.errors import CheckpointError
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def _states(value: float, width: int = 32) -> dict:
    model = nn.Linear(width, 16, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model}


def _save(url: str, opts: dict, local: str, steps: tuple[int, ...], width: int = 32) -> None:
    ck = Checkpointer(local, every_steps=1, async_mode="sync", remote=url, storage_options=opts)
    for step in steps:
        ck.maybe_save(step, _states(float(step), width))
    ck.close()


def _downloads(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".restore-"))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_damaged_remote_file_leaves_no_download_behind(s3_server, s3_bucket, tmp_path):
    opts = dict(s3_server.storage_options, skip_instance_cache=True)
    _save(s3_bucket, opts, str(tmp_path / "saver"), (1, 2))
    fs = s3fs.S3FileSystem(**opts)
    shard = f"{s3_bucket.removeprefix('s3://')}/step-00000002/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    fs.pipe_file(shard, bytes(data))
    here = tmp_path / "node1"
    here.mkdir()
    # left by killed processes: this rank's goes, another rank's (maybe downloading now) stays
    mine = here / f".restore-step-00000002-rank0-{_dead_pid()}"
    theirs = here / f".restore-step-00000002-rank1-{_dead_pid()}"
    for d in (mine, theirs):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    events: list[dict] = []
    ck = Checkpointer(
        str(here), async_mode="sync", remote=s3_bucket, storage_options=opts, on_event=events.append
    )
    states = _states(-1.0)
    assert ck.restore_latest(states) == 1
    assert torch.all(states["model"].weight == 1.0)
    (restore,) = [e for e in events if e["type"] == "restore"]
    assert [s["step"] for s in restore["skipped"]] == [2], restore["skipped"]
    assert "checksum" in restore["skipped"][0]["reason"], restore["skipped"]
    assert _downloads(str(here)) == [theirs.name]
    ck.close()


def test_a_full_local_disk_leaves_no_partial_download_behind(s3_server, s3_bucket, tmp_path):
    opts = dict(s3_server.storage_options, skip_instance_cache=True)
    _save(s3_bucket, opts, str(tmp_path / "saver"), (1,), width=65536)  # a 4 MiB shard
    try:
        with tmpfs(tmp_path / "small", "2m") as small:
            events: list[dict] = []
            ck = Checkpointer(
                small, async_mode="sync", remote=s3_bucket, storage_options=opts,
                on_event=events.append,
            )  # fmt: skip
            states = _states(-1.0, 65536)
            # not "no checkpoint": starting from scratch beside it would drop its progress
            with pytest.raises(CheckpointError, match="could not be read") as err:
                ck.restore_latest(states)
            msg = str(err.value)
            assert msg.startswith(f"{s3_bucket}/step-00000001 could not be read")
            assert "Nothing was loaded" in msg
            assert "__0_0.distcp" in msg and "free space there" in msg, msg
            assert "check the URL" not in msg  # the store was fine: the local disk is full
            assert _downloads(small) == []
            assert torch.all(states["model"].weight == -1.0)
            assert not [e for e in events if e["type"] == "restore"]
            ck.close()
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


def test_a_symlink_where_the_download_goes_is_never_written_through(s3_server, s3_bucket, tmp_path):
    """Another local user who can write the local root plants ``.restore-*`` names as links
    to a directory of the job's user: the restore downloads into a directory of its own,
    the links go as links, and the directory they point at is left exactly as it was."""
    opts = dict(s3_server.storage_options, skip_instance_cache=True)
    _save(s3_bucket, opts, str(tmp_path / "saver"), (1, 2))
    here = tmp_path / "node1"
    here.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("mine")
    for name in ("step-00000002", "step-00000001"):  # this process's download names
        (here / f".restore-{name}-rank0-{os.getpid()}").symlink_to(victim)
    ck = Checkpointer(str(here), async_mode="sync", remote=s3_bucket, storage_options=opts)
    states = _states(-1.0)
    assert ck.restore_latest(states) == 2
    assert torch.all(states["model"].weight == 2.0)
    assert os.listdir(victim) == ["precious"] and (victim / "precious").read_text() == "mine"
    assert _downloads(str(here)) == []  # the links removed (as links), the download too
    ck.close()
