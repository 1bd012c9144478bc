"""The memory tier under torchrun: a worker killed mid-run comes back from its node's
memory, at most one step lost, and the run ends bit-exact with an uninterrupted one: FSDP2
on 2 ranks, DDP on 3.

FSDP2 shards the model with ``fully_shard`` (``train.parallel=fsdp``: every model and
optimizer tensor a sharded DTensor); DDP on 3 ranks is where the gradient all-reduce's sum
depends on its bucket layout (the loop's ``exact_ddp`` keeps one: steadytrain/ddp.py). Both
runs snapshot into memory every step; durable checkpoints every 4 steps. The crashed run's worker of rank 1 is SIGKILLed mid-step at a
step that is not a durable one, so a restore from durable storage would lose steps and
``report`` would say so: the assertions read the tier and the steps lost from it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import STEPS  # noqa: E402
from harness import assert_same_run, start_torchrun, wait_torchrun  # noqa: E402

from steadytrain.testing.incidents.elastic import restores  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

KILL_AT = 7  # mid-step, between durable checkpoints 4 and 8


def _settings(run_dir: str, dataset: str, memory_dir: str, parallel: str, batch: int) -> list:
    return [
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        f"train.max_steps={STEPS}",
        f"train.parallel={parallel}",
        f"data.global_batch={batch}",
        "checkpoint.memory.every_steps=1",
        f"checkpoint.memory.dir={memory_dir}",
    ]


@pytest.mark.parametrize(
    ("parallel", "ranks", "batch"), [("fsdp", 2, 8), ("ddp", 3, 12)], ids=["fsdp2-2", "ddp-3"]
)
def test_resumes_from_memory_bit_exact(dataset, tmp_path, parallel, ranks, batch) -> None:
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    procs = [  # side by side: most of a run is start-up
        start_torchrun(ranks, _settings(ref_dir, dataset, str(tmp_path / "m0"), parallel, batch)),
        start_torchrun(
            ranks,
            _settings(run_dir, dataset, str(tmp_path / "m1"), parallel, batch),
            faults=f"kill_at_steps={KILL_AT};kill_rank=1",
            max_restarts=2,
        ),
    ]
    for proc in procs:
        wait_torchrun(proc, timeout=300)

    [r] = restores(run_dir)
    assert r["tier"] == "local-memory", r
    # Not durable step 4. The snapshot of step KILL_AT - 1 is written in the background
    # during step KILL_AT, so a kill can land while it is still in flight (under load it
    # was): the tier then restores the generation before it, and the ledger's last step is
    # at most one past the restored one.
    assert r["step"] >= KILL_AT - 2 and r["steps_lost"] <= 1, r
    ref = assert_same_run(run_dir, ref_dir, STEPS, global_batch=batch)
    assert ref[1]["world"] == ranks
