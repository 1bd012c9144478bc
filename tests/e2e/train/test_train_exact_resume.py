"""Crash and resume under torchrun is bit-exact on CPU.

Compares an uninterrupted 2-rank run with a 2-rank run that torchrun restarts after three
SIGKILLs (two mid-step at seeded random steps, one while an async checkpoint is being
written):
- final model weights: SHA-256 of every parameter's bytes, equal;
- per-step loss (mean over ranks), for every step 1..STEPS, equal as floats (bit for bit);
- per-step sample ids (rank 0's, then rank 1's), equal: no sample seen twice, none skipped;
- every step a crashed attempt ran and the next attempt redid gave the same loss again;
- the ledger shows the crashes: 4 attempts, each restored the checkpoint before its crash
  (the save in flight at the third crash never committed, so its predecessor was used).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import STEPS  # noqa: E402
from harness import effective, final, ledger, read_trace, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EVERY = 4  # checkpoint.every_steps in harness.BASE_SETTINGS


def test_crash_resume_is_bit_exact(dataset: str, baseline: str, tmp_path) -> None:
    rng = random.Random(20261129)
    # Mid-step crashes at seeded random steps, not right after a checkpoint step.
    mid = [rng.choice([s for s in range(2, 12) if s % EVERY > 1])]
    mid += [rng.choice([s for s in range(13, STEPS) if s % EVERY > 1 and s != 17])]
    save_kill = 16  # a checkpoint step: killed while that save is being written
    run_dir = str(tmp_path / "run")
    faults = (
        f"kill_at_steps={','.join(map(str, mid))};kill_in_save_at_steps={save_kill};kill_rank=1"
    )
    run_torchrun(
        2,
        [f"run_dir={run_dir}", f"data.dataset={dataset}", f"train.max_steps={STEPS}"],
        faults=faults,
        max_restarts=4,
    )

    ref, got = effective(read_trace(baseline)), effective(read_trace(run_dir))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], f"step {step} samples"
        assert got[step]["loss"] == ref[step]["loss"], f"step {step} loss"
    all_ids = [i for s in range(1, STEPS + 1) for i in got[s]["sample_ids"]]
    assert len(all_ids) == len(set(all_ids)) == STEPS * 8
    assert final(run_dir)["weights"] == final(baseline)["weights"]
    assert final(run_dir)["step"] == STEPS

    # Redone steps: the crashed attempts' records agree with the final ones, bit for bit.
    redone = [r for r in read_trace(run_dir) if r["rank"] == 0]
    for r in redone:
        assert r["loss"] == ref[r["step"]]["loss"], f"attempt {r['attempt']} step {r['step']}"

    # The ledger: one job_start per attempt, each resumed from the checkpoint before its crash.
    starts = [r for r in ledger(run_dir) if r["type"] == "job_start"]
    crashes = sorted(mid + [save_kill])
    restored = [s["restored_step"] for s in starts]
    assert len(restored) == 4 and restored[0] == 0, restored
    for crash, step in zip(crashes, restored[1:], strict=True):
        # The newest checkpoint before the crash; one older if the newest was still being
        # written when the crash hit. Never the save the crash interrupted.
        newest = (crash - 1) // EVERY * EVERY
        assert step % EVERY == 0 and step in (newest, newest - EVERY), (crashes, restored)
    fired = sorted(os.listdir(os.path.join(run_dir, "faults")))
    assert sum(name.endswith(".fired") for name in fired) == 3
