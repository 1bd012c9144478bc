"""A new run in a reused run directory never resumes the old run from memory (issue 40, 2).

Issue 40's reproduction (a), under torchrun: a run snapshots into memory every step and is
killed at step 6 (every rank, mid-step, no restart), ``rm -rf RUN``, and a new run with
another learning rate starts under the same ``run_dir``, the same memory directory and the
same rendezvous id (this harness always passes ``--rdzv-id=steadytest``, so the job
identity, and with it the memory folder's name, is the same). Before the fix it printed
"resumed from step 5" from ``local-memory`` and took its learning rate from the old
schedule. Now it starts from step 0: the old snapshots carry the old run's nonce, its
restore record passes over each of them as "written by another run", and ``steadytrain
report`` says so.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import ledger, read_trace, run_torchrun  # noqa: E402

from steadytrain.testing.incidents.common import report  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

STEPS = 8


def test_a_new_run_in_a_reused_run_dir_starts_afresh(dataset: str, tmp_path) -> None:
    run_dir, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    settings = [
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        f"train.max_steps={STEPS}",
        "checkpoint.memory.every_steps=1",
        f"checkpoint.memory.dir={mem}",
    ]
    old = run_torchrun(2, settings, faults="kill_at_steps=6;kill_rank=-1", check=False)
    assert old.returncode != 0, old.stdout[-2000:]
    left = sorted(glob.glob(os.path.join(mem, "*", "rank*", "step-*.snap")))
    assert len(left) >= 2, left  # the old run's snapshots are still in memory
    shutil.rmtree(run_dir)

    new = run_torchrun(2, [*settings, "optim.lr=3e-3"])
    assert "resumed from" not in new.stdout + new.stderr
    assert min(r["step"] for r in read_trace(run_dir)) == 1  # trained from the start
    (restore,) = [r for r in ledger(run_dir) if r["type"] == "restore"]
    assert restore["step"] == 0, restore
    snaps = [s for s in restore["skipped"] if s["path"].endswith(".snap")]
    assert {os.path.basename(os.path.dirname(s["path"])) for s in snaps} == {
        "rank00000",
        "rank00001",
    }  # every rank's copies, gathered into rank 0's record
    assert all("written by another run (nonce" in s["reason"] for s in snaps), snaps
    rep = report(run_dir, plots=False)
    assert rep["restores"] == []  # nothing was restored
    why = [p["reason"] for p in rep["restores_passed_over"]]
    assert sum("written by another run" in w for w in why) == len(snaps), why
