"""examples/lightning_callback.py (its default, ``SteadyDDPStrategy``): Lightning saves what
``ModelCheckpoint`` asks for through steadytrain's ``Checkpointer`` and resumes by itself.

Under the real torchrun, on 2 and on 3 CPU ranks, three runs side by side: uninterrupted,
rank 1 SIGKILLed at the start of step 10, and rank 0 SIGKILLed while the checkpoint of step
8 is written (its shards on disk, its COMMIT not). Each crashed run is restarted by
torchrun and resumes with no ``ckpt_path``: from step 4 or 8 after the mid-step kill
(``ModelCheckpoint`` saves every 4 steps; the save of 8 may or may not have committed when
the kill came), from step 4 after the mid-save kill, the partial step-8 directory skipped
and named in the report. Every step's sample ids and loss, and the final weights, equal the
uninterrupted run's (``exact_ddp`` through ``ExactResume`` at 3 ranks).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from example_runs import EXAMPLES, SAVE_CRASH, STEPS, assert_restored, run_kills
from harness import assert_same_run
from warm_pool import prestart_module

# Looked up, not imported: importing lightning costs seconds of CPU in every test process
# that collects this file, the inner loop's too (it leaves this e2e file out after collection).
NEEDS_LIGHTNING = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="no lightning"
)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), NEEDS_LIGHTNING]
# Both cases on one worker, with one warm process started as the module begins (warm_pool).
warm_module = prestart_module(os.path.join(EXAMPLES, "lightning_callback.py"))


@pytest.mark.parametrize("ranks", [2, 3])
def test_lightning_strategy_resumes_exactly_after_kills_mid_step_and_mid_save(
    dataset: str, tmp_path, ranks: int
) -> None:
    batch = 4 * ranks  # 2 micro-batches of 2 per rank and step
    dirs = run_kills(
        "lightning_callback.py", dataset, str(tmp_path), ranks, "--global-batch", str(batch)
    )
    for name in ("mid_step", "mid_save"):
        assert_same_run(dirs[name], dirs["ref"], STEPS, global_batch=batch)
    assert_restored(dirs["mid_step"], (4, 8))
    assert_restored(dirs["mid_save"], (SAVE_CRASH - 4,), skipped=f"step-{SAVE_CRASH:08d}")
