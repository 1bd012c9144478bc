"""The trainer plugins restore from the memory tier exactly, under the real torchrun.

Each example (``SteadyDDPStrategy``, ``SteadytrainTrainer``) on 2 CPU ranks with a memory
snapshot every step and no durable checkpoint before the final save; rank 1 SIGKILLed at
the start of step 10, torchrun restarts both, and each resumes from its own node's memory
(``local-memory``, step 8 or 9: the snapshot of 9 may not have landed). Every step's sample
ids and loss, and the final weights, equal an uninterrupted run's.

Why HF needs it: the Trainer makes its LR scheduler after steadytrain's restore, and the
scheduler's constructor resets every optimizer group's ``lr``. A durable restore hid that
(DCP loads only the keys the live optimizer already has), a memory restore did not (its
groups carry ``initial_lr``, so the first step after it ran at the base LR): the plugin
puts the restored groups back after the scheduler is made, as the Trainer's own resume does.
The node-harness test (tests/nodes/test_trainer_node_loss.py) runs the peer's copy.
"""

from __future__ import annotations

import pytest
from example_runs import CRASH_AT, STEPS, assert_kill_reported, finish, start_example
from harness import assert_same_run

from steadytrain.testing.incidents.common import report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FLAGS = ("--save-every", "1000", "--memory-every", "1")


@pytest.mark.parametrize("script", ["hf_trainer_callback.py", "lightning_callback.py"])
def test_a_trainer_job_resumes_exactly_from_its_memory_snapshots(
    dataset: str, tmp_path, script: str
) -> None:
    pytest.importorskip("transformers" if script.startswith("hf") else "lightning.pytorch")
    ref, crashed = str(tmp_path / "ref"), str(tmp_path / "crashed")
    procs = [
        start_example(script, dataset, ref, 0, 2, *FLAGS),
        start_example(script, dataset, crashed, CRASH_AT, 2, *FLAGS),
    ]
    outs = [finish(p) for p in procs]
    assert_kill_reported(outs[1], killed=1)
    assert_same_run(crashed, ref, STEPS, global_batch=8)
    rep = report(crashed, plots=False)
    [row] = rep["restores"]
    assert row["tier"] == "local-memory" and row["step"] in (CRASH_AT - 2, CRASH_AT - 1), row
