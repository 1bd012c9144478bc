"""examples/hf_trainer_callback.py ``--checkpoints hf``:
``steadytrain.integrations.hf.SteadytrainCallback`` in a
Hugging Face ``Trainer`` (tiny random-init Llama, 2 CPU ranks under the real torchrun) that
keeps its own checkpoints and ``resume_from_checkpoint``.

Rank 1 is SIGKILLed at the start of step 10 of the first attempt; rank 0 dies of gloo's
"Connection reset by peer" inside ``Trainer.train`` (which calls no callback then: the
callback's exit guard records the exception), torchrun restarts both ranks, the Trainer
resumes from its checkpoint of step 8 and finishes. The ledger and ``steadytrain report``
show what ``steadytrain train`` shows: the crash, the restart gap, the Trainer's saves and
the steps of both attempts.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from example_runs import (
    CRASH_AT,
    EXAMPLES,
    STEPS,
    assert_evaluations_are_eval,
    assert_finished_without_hang,
    assert_kill_reported,
    finish,
    start_example,
)
from warm_pool import prestart_module, python

from steadytrain.testing.incidents.common import report as _report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "hf_trainer_worker.py")
# The module on one worker, the warm process of its first test started as it begins
# (warm_pool); WORKER's starts at its first use, so the two preloads do not compete.
warm_module = prestart_module(os.path.join(EXAMPLES, "hf_trainer_callback.py"))


def test_hf_trainer_callback_records_crash_and_resume(dataset: str, tmp_path) -> None:
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / "hft")
    script = "hf_trainer_callback.py"
    out = finish(start_example(script, dataset, run_dir, CRASH_AT, 2, "--checkpoints", "hf"))
    assert_kill_reported(out, killed=1)
    with open(os.path.join(run_dir, "final.json")) as f:
        assert json.load(f)["step"] == STEPS

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    starts = [r for r in records if r["type"] == "job_start"]
    assert [s["attempt"] for s in starts] == [0, 1]
    assert [s["restored_step"] for s in starts] == [0, 8]  # the Trainer's checkpoint-8
    restores = [r for r in records if r["type"] == "restore"]
    assert restores[1]["path"].endswith("checkpoint-8"), restores
    # The steps of both attempts, in the order they ran: 1..9, then 9..12 after the resume.
    attempt, steps = -1, {0: [], 1: []}
    for r in records:
        if r["type"] == "job_start":
            attempt = r["attempt"]
        elif r["type"] == "step":
            steps[attempt].append(r)
    assert [r["step"] for r in steps[0]] == list(range(1, CRASH_AT))
    assert [r["step"] for r in steps[1]] == list(range(9, STEPS + 1))
    # Each step carries its loss from on_log; the Trainer's resume redoes step 9 exactly.
    assert all(isinstance(r["loss"], float) for r in steps[0] + steps[1])
    assert steps[0][8]["loss"] == steps[1][0]["loss"]
    # The Trainer's own saves are checkpoint records, their time the step's block.
    ckpts = [r for r in records if r["type"] == "checkpoint"]
    assert [r["step"] for r in ckpts] == [4, 8, 12]
    assert all(r["ok"] and r["path"].endswith(f"checkpoint-{r['step']}") for r in ckpts)
    saved = [r for r in steps[0] + steps[1] if r["checkpoint_block_s"] > 0]
    assert [r["step"] for r in saved] == [4, 8, 12]
    ends = [r for r in records if r["type"] == "job_end"]
    # Rank 0 dies of the broken collective (an exception the callback's excepthook sees)
    # or, if torchrun's SIGTERM comes first, of that signal: a crash either way.
    crash = ends[0]["reason"]
    assert crash.startswith("error: RuntimeError") or crash == "signal: SIGTERM", crash
    assert ends[1]["reason"] == "finished"

    rep = _report(run_dir, plots=False)
    assert [c["attempt"] for c in rep["crashes"]] == [0], rep["crashes"]
    assert rep["crashes"][0]["reason"] == crash
    assert rep["restarts"] == 1
    assert rep["badput"]["restart_gap"] > 0, rep["badput"]
    assert rep["badput"]["startup"] > 0, rep["badput"]
    assert rep["badput"]["checkpoint_block"] > 0, rep["badput"]
    assert rep["last_step"] == STEPS
    # The Trainer loaded checkpoint-8 before the callback's Run opened: in the start-up, and
    # the Restores table says so (issue 42: it read "durable 0.00 s").
    assert [(r["step"], r["tier"], r["seconds"], r["in_startup"]) for r in rep["restores"]] == [
        (8, "trainer", None, True)
    ]


@pytest.mark.parametrize(
    ("fail", "code", "reason"),
    [
        ("raise", 1, "error: ValueError: injected failure at step 3"),
        ("sigterm", 128 + 15, "signal: SIGTERM"),
    ],
)
def test_hf_trainer_callback_failure_is_a_crash(dataset, tmp_path, fail, code, reason) -> None:
    """An exception out of ``Trainer.train`` (no callback is called for it) and a SIGTERM
    (Run's ``Terminated``, a SystemExit only ``atexit`` sees) each end the attempt as a
    crash with its reason, never the clean ``interpreter_exit`` of the meter's exit hook."""
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / fail)
    proc = subprocess.run(
        **python(WORKER, dataset, run_dir, "--fail", fail, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stderr[-4000:]
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2]
    ends = [r for r in records if r["type"] == "job_end"]
    assert [e["reason"] for e in ends] == [reason]
    if fail == "raise":  # the user still sees the traceback (the excepthook chains)
        assert "ValueError: injected failure at step 3" in proc.stderr
    rep = _report(run_dir, plots=False)
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(0, reason)]


def test_hf_trainer_callback_hang_is_detected(dataset, tmp_path) -> None:
    """A step that never ends: the callback's watchdog (liveness is the Trainer's
    ``on_step_end``) records a hang and exits 124, so torchrun would restart the job."""
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / "hang")
    proc = subprocess.run(
        **python(WORKER, dataset, run_dir, "--fail", "hang", "--at", "3", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 124, proc.stderr[-4000:]
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    hangs = [r for r in records if r["type"] == "hang"]
    assert hangs and hangs[0]["step"] == 2, records[-3:]


FLOOR_S = 2.0  # the worker's step and checkpoint deadlines


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_hf_trainer_evaluation_longer_than_the_step_deadline_is_no_hang(
    dataset, tmp_path, strategy
) -> None:
    """Issue 40: an evaluation of 2x the step deadline (and of the checkpoint deadline,
    both FLOOR_S) every 4 steps used to end the job with exit 124 inside the evaluation:
    ``"epoch"`` evaluates after ``on_epoch_end``, where no phase was declared, ``"steps"``
    under the checkpoint's deadline. Each now runs in the declared ``"eval"`` phase under
    its own deadline (``phases.eval_s``, 5 x FLOOR_S) and the job finishes.

    Issue 42: the Trainer also saves at each evaluated step (``"steps"``: evaluate, then
    save; ``"epoch"``: save, then evaluate). The evaluations were booked as the next step's
    data wait or as the save's blocking; they are now the ``eval`` bucket, and the plan
    from this run takes the saves' own cost."""
    run_dir = str(tmp_path / strategy)
    cmd = [dataset, run_dir, "--fail", "none", "--eval", strategy]
    proc = subprocess.run(
        **python(WORKER, *cmd, "--eval-s", str(2 * FLOOR_S), "--floor", str(FLOOR_S),
                 OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run_dir, "log_history.json")) as f:
        evals = [h for h in json.load(f) if "eval_runtime" in h]
    assert [h["step"] for h in evals] == [4, 8]
    assert all(h["eval_runtime"] >= 2 * FLOOR_S for h in evals), evals
    assert_finished_without_hang(run_dir, 8, proc.stderr)
    assert_evaluations_are_eval(run_dir, sum(h["eval_runtime"] for h in evals), 2 * FLOOR_S)
