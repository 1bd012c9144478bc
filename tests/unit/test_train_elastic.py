"""Elastic launches that cannot work are refused or named at start (issue 12, item 12).

``torchrun --nnodes 3:4 --nproc-per-node 8`` with ``global_batch=256`` and micro-batch 8
runs at 4 nodes (32 ranks) and cannot run at 3 (24 x 8 = 192 does not divide 256): the
start-up check refuses the world size it is given before any work, and warns about the
other node counts of ``train.elastic_nnodes``. ``steadytrain stage --config`` stages what
the training config's own seq_len and global batch read."""

from __future__ import annotations

import json
import os
import sys

import pytest

from steadytrain.cli import main
from steadytrain.errors import ConfigError
from steadytrain.testing import forkserver
from steadytrain.train.config import config_from_dict
from steadytrain.train.support import check_world_sizes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, make_dataset  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_the_current_world_size_must_split_the_batch() -> None:
    with pytest.raises(ConfigError) as err:
        check_world_sizes(256, 8, 24, 8, (3, 4))
    msg = str(err.value)
    assert "world size 24 (3 node(s) x 8)" in msg and "data.global_batch=256" in msg
    assert "a multiple of 768" in msg and "launch on 4 node(s)" in msg  # the fixes
    with pytest.raises(ConfigError, match="world size 3 .*data.global_batch=16.*multiple of 12"):
        check_world_sizes(16, 4, 3, 3)  # no range given: only this world is known


def test_other_node_counts_of_the_range_are_named_at_start() -> None:
    warning = check_world_sizes(256, 8, 32, 8, (3, 4))  # runs at 4 nodes, not at 3
    assert warning is not None
    assert "data.micro_batch=8: 3 node(s) = world size 24. " in warning  # and only that one
    assert "multiple of 768" in warning
    gaps = check_world_sizes(256, 8, 16, 8, (2, 5))
    assert gaps is not None and "3 node(s) = world size 24, 5 node(s) = world size 40" in gaps
    assert "keep --nnodes to 2 or 4 node(s)" in gaps
    assert check_world_sizes(768, 8, 24, 8, (3, 4)) is None  # the documented numbers work
    assert check_world_sizes(256, 8, 32, 8) is None


def test_elastic_nnodes_is_parsed_and_checked_with_the_config() -> None:
    def train(value: str) -> object:
        raw = {"data": {"dataset": "/d", "seq_len": 16, "global_batch": 8, "micro_batch": 2}}
        return config_from_dict({**raw, "train": {"elastic_nnodes": value}}).train

    assert train("3:4").nnodes_range == (3, 4)
    assert train("4").nnodes_range == (4, 4)
    assert train("").nnodes_range is None
    for bad in ("4:3", "0:2", "three"):
        with pytest.raises(
            ConfigError, match='train.elastic_nnodes = .* --nnodes value, "MIN:MAX"'
        ):
            train(bad)


def _train(run_dir: str, dataset: str, env: dict[str, str], *settings: str):
    cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
    for s in [*BASE_SETTINGS, f"run_dir={run_dir}", f"data.dataset={dataset}", *settings]:
        cmd += ["--set", s]
    launcher = {"MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"}
    env = {
        **{k: v for k, v in os.environ.items() if k not in launcher},
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return forkserver.run(cmd, env=env, timeout=100)


def test_train_refuses_a_world_size_that_cannot_split_the_batch(tmp_path) -> None:
    """What torchrun tells each worker at 3 nodes of 8: the run stops with exit 2 before it
    creates anything, naming the world size and the global batch."""
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run_dir = tmp_path / "run"
    at_three = {"WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "3"}
    refused = _train(
        str(run_dir),
        ds,
        at_three,
        "data.global_batch=256",
        "data.micro_batch=8",
        "train.elastic_nnodes=3:4",
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "world size 24" in refused.stderr and "data.global_batch=256" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not run_dir.exists()  # refused before any work: no run directory, no ledger


def test_train_warns_at_start_about_node_counts_that_would_fail(tmp_path) -> None:
    """A real one-process run whose range 1:3 includes a world of 3 that cannot split a
    batch of 8 in micro-batches of 2: it trains, and says so before its first step."""
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run = _train(str(tmp_path / "run"), ds, {}, "train.max_steps=2", "train.elastic_nnodes=1:3")
    assert run.returncode == 0, run.stderr[-3000:]
    warning = [line for line in run.stderr.splitlines() if "elastic_nnodes" in line]
    assert len(warning) == 1 and "3 node(s) = world size 3" in warning[0]
    assert run.stderr.index("elastic_nnodes") < run.stderr.index("[train] step")


def test_stage_takes_the_run_settings_from_the_training_config(tmp_path, capsys) -> None:
    """``stage --config demo`` stages what the demo's seq_len 128 x batch 16 read, not what
    the flag defaults (2048 x 512) would; an explicit flag still wins."""
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=400_000)  # 4 shards
    args = ["stage", ds, "--steps", "0:1", "--json", "--config", "demo"]
    assert main([*args, "--cache", str(tmp_path / "c1"), "--set", "data.shuffle=sequential"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert staged["run_settings"] == {
        "seq_len": 128,
        "global_batch": 16,
        "seed": 0,
        "shuffle": "sequential",
    }
    assert staged["shards"] == 1  # 2048 tokens of step 0 lie in the first shard
    assert main(["stage", ds, "--steps", "0:1", "--json", "--cache", str(tmp_path / "c2"),
                 "--shuffle", "sequential"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["shards"] == 4  # 2048 x 512 tokens: all
    flag = [*args, "--cache", str(tmp_path / "c3"), "--set", "data.shuffle=sequential"]
    assert main([*flag, "--global-batch", "2048"]) == 0
    assert json.loads(capsys.readouterr().out)["run_settings"]["global_batch"] == 2048
    assert main(["stage", ds, "--cache", str(tmp_path / "c4"), "--set", "seed=1"]) == 2
    assert "give --config CONFIG too" in capsys.readouterr().err
