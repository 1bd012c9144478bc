"""FSDP2 with the memory tier under torchrun: a worker killed mid-run comes back from its
node's memory, at most one step lost, and the run ends bit-exact with an uninterrupted one.

Both runs shard the model with ``fully_shard`` (``train.parallel=fsdp``: every model and
optimizer tensor a sharded DTensor) and snapshot into memory every step; durable
checkpoints every 4 steps. The crashed run's worker of rank 1 is SIGKILLed mid-step at a
step that is not a durable one, so a restore from durable storage would lose steps and
``report`` would say so: the assertions read the tier and the steps lost from it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import STEPS  # noqa: E402
from harness import effective, final, read_trace, run_torchrun  # noqa: E402

from steadytrain.testing.incidents.elastic import restores  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

KILL_AT = 7  # mid-step, between durable checkpoints 4 and 8


def _settings(run_dir: str, dataset: str, memory_dir: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        f"train.max_steps={STEPS}",
        "train.parallel=fsdp",
        "checkpoint.memory.every_steps=1",
        f"checkpoint.memory.dir={memory_dir}",
    ]


def test_fsdp2_resumes_from_memory_bit_exact(dataset: str, tmp_path) -> None:
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    run_torchrun(2, _settings(ref_dir, dataset, str(tmp_path / "mem-ref")))
    run_torchrun(
        2,
        _settings(run_dir, dataset, str(tmp_path / "mem-run")),
        faults=f"kill_at_steps={KILL_AT};kill_rank=1",
        max_restarts=2,
    )

    [r] = restores(run_dir)
    assert r["tier"] == "local-memory", r
    assert r["step"] == KILL_AT - 1 and r["steps_lost"] <= 1, r  # not durable step 4
    ref, got = effective(read_trace(ref_dir)), effective(read_trace(run_dir))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], f"step {step} samples"
        assert got[step]["loss"] == ref[step]["loss"], f"step {step} loss"
    assert final(run_dir)["weights"] == final(ref_dir)["weights"]
