"""`steadytrain train` (alone, no torchrun) resumed with another `data.global_batch`: it goes
on at the saved sample position with the new batch size and records the change in the
ledger; resumed with another `data.seq_len` it stops before loading anything, names both
values and advises deleting nothing (the checkpoints verify)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from steadytrain.testing import forkserver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, effective, ledger, make_dataset, read_trace  # noqa: E402

from steadytrain.checkpoint.inspect import list_checkpoints  # noqa: E402
from steadytrain.data.read.dataset import TokenDataset  # noqa: E402
from steadytrain.data.read.loader import LoaderConfig, TokenLoader  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _train(run_dir: str, dataset: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
    for s in [*BASE_SETTINGS, f"run_dir={run_dir}", f"data.dataset={dataset}", *extra]:
        cmd += ["--set", s]
    env = dict(os.environ, STEADYTRAIN_FAULTS="", OMP_NUM_THREADS="1")
    return forkserver.run(cmd, env=env, timeout=200)


def _stream(dataset: str, config: dict, steps: int) -> list[list[int]]:
    """Sample ids per step of the run's own stream at global batch 8, read in this process
    with the loader settings the run recorded in its ledger."""
    names = {f.name for f in dataclasses.fields(LoaderConfig)}
    cfg = LoaderConfig(**{k: v for k, v in config["data"].items() if k in names})
    with TokenLoader(TokenDataset.open(dataset), seed=config["seed"], config=cfg) as ld:
        return [
            [i for _ in range(ld.micro_per_step) for i in next(ld)["sample_ids"].tolist()]
            for _ in range(steps)
        ]


def test_resume_with_a_new_global_batch_then_refuse_a_new_seq_len(tmp_path) -> None:
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=100_000)
    run = str(tmp_path / "run")
    first = _train(run, ds, "train.max_steps=4")  # global batch 8; checkpoint at step 4
    assert first.returncode == 0, first.stderr[-3000:]

    resumed = _train(run, ds, "train.max_steps=6", "data.global_batch=16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr
    records = ledger(run)
    starts = [r for r in records if r["type"] == "job_start"]
    stream = _stream(ds, starts[0]["config"], 8)
    steps = effective(read_trace(run))
    assert [steps[s]["sample_ids"] for s in range(1, 5)] == stream[:4], "reference check"
    # Steps 5 and 6 hold 16 samples each: positions 32..64, i.e. steps 5-8 at batch 8.
    assert steps[5]["sample_ids"] == stream[4] + stream[5]
    assert steps[6]["sample_ids"] == stream[6] + stream[7]
    restores = [r for r in records if r["type"] == "restore" and r["step"] == 4]
    assert restores and restores[-1]["changes"] == [
        {"state": "loader", "key": "global_batch", "old": 8, "new": 16, "step": 4, "position": 32}
    ]
    tokens = {r["step"]: r["tokens"] for r in records if r["type"] == "step"}
    assert tokens[4] == 8 * 64 and tokens[6] == 16 * 64
    assert starts[-1]["config"]["data"]["global_batch"] == 16

    refused = _train(run, ds, "train.max_steps=8", "data.global_batch=16", "data.seq_len=32")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "saved with seq_len=64, loader has seq_len=32" in refused.stderr
    assert "verifies" in refused.stderr and "Nothing was loaded" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "remove" not in refused.stderr.lower() and "delete" not in refused.stderr.lower()
    rows = list_checkpoints(os.path.join(run, "checkpoints"))
    assert rows and all(r["verifies"] for r in rows if r["state"] == "committed")
    assert rows[0]["step"] == 6, "the newest checkpoint is still there"
    assert max(r["step"] for r in ledger(run) if r["type"] == "step") == 6, "nothing trained"
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
