"""``Run.step_done`` takes only step numbers that lose no work, and a closed ``Run`` says so
(issue 40, 3), in one process.

A loop that ignores ``start_step`` and counts from 1 again made the final save commit newer
weights under an older step (the next start restored the older one); ``step_done(10**30)``
made a checkpoint directory of that number; ``step_done(nan)`` killed the meter's thread;
``step_done`` after the ``with`` raised ``AttributeError``. The step checks are also unit
tested as the pure function ``run_support.check_step``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from steadytrain import Run
from steadytrain.checkpoint.commit import MAX_STEP, commit_bytes
from steadytrain.monitor.ledger import read_ledger
from steadytrain.run_support import check_step


def _steps(run_dir) -> list[int]:
    return [r["step"] for r in read_ledger(os.path.join(run_dir, "ledger.jsonl")) if r["type"] == "step"]  # fmt: skip


@pytest.mark.parametrize(
    "value",
    [
        True,
        5.0,
        math.nan,
        np.float64(5),
        np.bool_(True),
        torch.tensor(5.0),
        torch.tensor(True),
        "5",
    ],
    ids=repr,
)
def test_a_step_that_is_not_an_integer_is_refused_naming_it(value) -> None:
    with pytest.raises(TypeError) as err:
        check_step(value, 4, 2)
    msg = str(err.value)
    assert f"step={value!r}" in msg and "previous step 4" in msg and "start_step 2" in msg


@pytest.mark.parametrize("value", [5, np.int64(5), torch.tensor(5), np.array(5)], ids=repr)
def test_integers_of_numpy_and_torch_are_steps(value) -> None:
    got = check_step(value, 4, 2)
    assert got == 5 and type(got) is int


def test_a_step_must_be_above_the_previous_and_below_2_to_the_53() -> None:
    for value in (4, 3, 0, -1):
        with pytest.raises(ValueError, match=rf"step={value}\): a step must be above") as err:
            check_step(value, 4, 2)
        assert "previous step 4, start_step 2" in str(err.value)
    assert check_step(MAX_STEP - 1, 4, 2) == MAX_STEP - 1
    for value in (MAX_STEP, 10**30):
        with pytest.raises(ValueError, match=r"below 2\*\*53"):
            check_step(value, 4, 2)


def test_a_loop_that_ignores_start_step_is_caught_at_its_first_step(tmp_path) -> None:
    with Run(tmp_path, {}, checkpoint=False, restored_step=7) as run:
        assert run.start_step == 7
        with pytest.raises(ValueError, match=r"step=1\).*previous step 7, start_step 7"):
            run.step_done(1)  # counting from 1 again after a restore of step 7
        run.step_done(8)
        with pytest.raises(ValueError, match=r"step=8\).*previous step 8, start_step 7"):
            run.step_done(8)  # the same step twice
    assert _steps(tmp_path) == [8]  # nothing of the refused calls was recorded


def test_nan_is_refused_in_the_callers_thread_and_the_meter_goes_on(tmp_path) -> None:
    died: list[threading.ExceptHookArgs] = []
    previous_hook = threading.excepthook
    threading.excepthook = died.append
    try:
        with Run(tmp_path, {}, checkpoint=False) as run:
            with pytest.raises(TypeError, match=r"step=nan"):
                run.step_done(math.nan)
            run.step_done(1)
            run.meter.flush()
    finally:
        threading.excepthook = previous_hook
    assert died == []
    recs = read_ledger(tmp_path / "ledger.jsonl")
    assert [r["step"] for r in recs if r["type"] == "step"] == [1]
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"


def test_an_absurd_step_makes_no_checkpoint_directory(tmp_path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    model = torch.nn.Linear(2, 2)
    with Run(
        tmp_path / "run",
        {"model": model},
        checkpoint={"every_steps": 1, "async_mode": "sync"},
        checkpoint_dir=str(ckpt_dir),
    ) as run:
        with pytest.raises(ValueError, match=r"below 2\*\*53"):
            run.step_done(10**30)
        run.step_done(1)
    assert sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step-")) == ["step-00000001"]


@pytest.mark.parametrize("call", ["step_done", "phase", "data_wait", "finish"])
def test_a_call_after_the_with_block_is_a_clear_error(tmp_path, call) -> None:
    args = {"step_done": (1,), "phase": ("checkpoint",), "data_wait": (), "finish": ()}[call]
    run = Run(tmp_path, {}, checkpoint=False)
    with pytest.raises(RuntimeError, match=rf"Run.{call}\(\) before the Run was entered"):
        getattr(run, call)(*args)
    with run:
        pass
    with pytest.raises(RuntimeError, match=rf"Run.{call}\(\) after the Run closed"):
        getattr(run, call)(*args)


@pytest.mark.timeout(120)  # before the fix the next start never ended (recovered steps)
def test_a_checkpoint_of_an_absurd_step_on_disk_is_skipped_as_damaged(tmp_path) -> None:
    run_dir, model = tmp_path / "run", torch.nn.Linear(2, 2)
    checkpoint = {"every_steps": 2, "async_mode": "sync"}
    with Run(run_dir, {"model": model}, checkpoint=checkpoint) as run:
        run.step_done(1)
        run.step_done(2)
    # What step_done(10**30) left on disk before: a checkpoint that verifies.
    ckpts = run_dir / "checkpoints"
    absurd = ckpts / f"step-{10**30}"
    shutil.copytree(ckpts / "step-00000002", absurd)
    manifest = json.loads((absurd / "COMMIT").read_text())
    (absurd / "COMMIT").write_bytes(commit_bytes({**manifest, "step": 10**30}))
    with Run(run_dir, {"model": model}, checkpoint=checkpoint) as run:
        assert run.start_step == 2
    restore = [r for r in read_ledger(run_dir / "ledger.jsonl") if r["type"] == "restore"][-1]
    assert restore["step"] == 2, restore
    skipped = restore["skipped"]
    assert [s["path"] for s in skipped] == [absurd.name], skipped
    assert str(absurd) in skipped[0]["reason"] and "is not below 2**53" in skipped[0]["reason"]
