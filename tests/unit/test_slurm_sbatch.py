"""``examples/slurm/train.sbatch`` and ``scripts/ensure-slurm.sh`` without a Slurm: syntax,
and a dry run of the sbatch script with ``srun``/``scontrol`` replaced by shims that record
their arguments, so the command lines built from the environment variables are checked in
milliseconds (``tests/nodes/test_nodes_slurm.py`` runs the same script under a real Slurm)."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "slurm", "train.sbatch")
ENSURE = os.path.join(REPO, "scripts", "ensure-slurm.sh")

SHIM = """#!/bin/bash
# records its argv (one shell-quoted line per call) and plays {name}
printf '{name}' >> "$SHIM_LOG"; printf ' %q' "$@" >> "$SHIM_LOG"; echo >> "$SHIM_LOG"
[ {name} = scontrol ] && printf 'nodeA\\nnodeB\\n'
exit 0
"""


@pytest.mark.parametrize("path", [SCRIPT, ENSURE])
def test_scripts_parse(path: str) -> None:
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _dry_run(tmp_path, **env: str) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        shim = bin_dir / name
        shim.write_text(SHIM.format(name=name))
        shim.chmod(0o755)
    log = tmp_path / "calls.log"
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SHIM_LOG": str(log),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "steady-small",
        "SLURM_JOB_NODELIST": "nodeA,nodeB",
    }
    r = subprocess.run(
        ["bash", SCRIPT], env={**base, **env}, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    port = env.get("RDZV_PORT", "29400")
    assert f"job 42 restart 0 on nodeA,nodeB, rendezvous nodeA:{port}" in r.stderr
    return [shlex.split(line) for line in log.read_text().splitlines()]


def test_defaults_are_the_documented_cluster_job(tmp_path) -> None:
    calls = _dry_run(tmp_path)
    srun = [c for c in calls if c[0] == "srun"]
    assert len(srun) == 2  # stage, then train
    stage, train = srun
    assert stage[stage.index("--steps") + 1] == "0:2000"
    assert stage[stage.index("--cache") + 1] == "/local_nvme/steady-cache"
    assert "--kill-on-bad-exit=0" in train and "--no-kill" in train
    for flag, value in {
        "--nnodes": "3:4",
        "--nproc-per-node": "8",
        "--rdzv-endpoint": "nodeA:29400",
        "--rdzv-id": "42",
        "--max-restarts": "20",
    }.items():
        assert train[train.index(flag) + 1] == value, flag
    sets = [train[i + 1] for i, a in enumerate(train) if a == "--set"]
    assert "data.global_batch=768" in sets and "train.elastic_nnodes=3:4" in sets
    assert "data.dataset=s3://bucket/datasets/web" in sets
    assert "run_dir=/shared/runs/steady-small" in sets
    assert "checkpoint.remote=s3://bucket/ckpt/steady-small" in sets
    assert train[train.index("train") + 1] == "small"  # CONFIG


def test_environment_overrides_reach_the_commands(tmp_path) -> None:
    calls = _dry_run(
        tmp_path,
        DATASET="s3://b/ds",
        RUN_DIR="/runs/x",
        LOCAL_CACHE="/disk",
        CONFIG="demo",
        NPROC_PER_NODE="1",
        NNODES="1:2",
        RDZV_PORT="29555",
        MAX_RESTARTS="3",
        STAGE_STEPS="",
        CKPT_REMOTE="",
        STEADYTRAIN_PY="/opt/py/bin/python",
        STEADY_SETTINGS="--set seed=7 --set train.max_steps=16",
    )
    srun = [c for c in calls if c[0] == "srun"]
    assert len(srun) == 1  # STAGE_STEPS empty: no staging step
    train = srun[0]
    assert train[train.index("--no-kill") + 1 :][:3] == [
        "/opt/py/bin/python",
        "-m",
        "torch.distributed.run",
    ]
    assert train[train.index("--nnodes") + 1] == "1:2"
    assert train[train.index("--rdzv-endpoint") + 1] == "nodeA:29555"
    sets = [train[i + 1] for i, a in enumerate(train) if a == "--set"]
    assert sets[:2] == ["seed=7", "train.max_steps=16"]
    assert "data.global_batch=768" not in sets  # STEADY_SETTINGS replaces the defaults
    assert "data.cache_dir=/disk" in sets and "run_dir=/runs/x" in sets
    assert not any(s.startswith("checkpoint.remote=") for s in sets)
