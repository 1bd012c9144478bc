"""examples/lightning_callback.py ``--checkpoints lightning``:
``steadytrain.integrations.lightning.SteadytrainCallback`` and ``ExactResume`` in a Lightning
``Trainer`` (tiny model, DDP on 2 and on 3 CPU ranks under
the real torchrun, a ``TokenLoader`` through a plain ``DataLoader``) that keeps its own
``ModelCheckpoint`` and ``fit(ckpt_path=...)``.

Rank 1 is SIGKILLed at the start of step 10 of the first attempt; rank 0 dies of the
broken all-reduce (Lightning calls ``on_exception``: the callback records the crash),
torchrun restarts the ranks, Lightning resumes from ``last.ckpt`` (step 8) and finishes.
Every step's sample ids and loss, and the final weights, equal an uninterrupted run's (run
beside it): Lightning fetched a batch ahead when it saved, and ``ExactResume`` saved the
loader's position as of the last batch trained on; at 3 ranks DDP's gradient layout is the
uninterrupted run's too. The ledger and ``steadytrain report`` show the crash, the restart
gap, Lightning's saves and the steps of both attempts. Single-process runs check an
exception, SIGTERM and a hang.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

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
from harness import assert_same_run
from warm_pool import prestart_module, python

from steadytrain.testing.incidents.common import report as _report

# Looked up, not imported: importing Lightning costs every test worker seconds at collection,
# and only the worker processes this file starts use it.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "lightning_worker.py")
# The module on one worker, the warm process of its first test started as it begins
# (warm_pool); WORKER's starts at its first use, so the two preloads do not compete.
warm_module = prestart_module(os.path.join(EXAMPLES, "lightning_callback.py"))


def _steps_by_attempt(records: list[dict]) -> dict[int, list[int]]:
    attempt, steps = -1, {}
    for r in records:
        if r["type"] == "job_start":
            attempt = r["attempt"]
            steps[attempt] = []
        elif r["type"] == "step":
            steps[attempt].append(r["step"])
    return steps


@pytest.mark.parametrize("ranks", [2, 3])
def test_lightning_crash_resume_is_exact_and_recorded(dataset: str, tmp_path, ranks) -> None:
    from steadytrain.monitor.ledger import read_ledger

    batch = 4 * ranks  # 2 micro-batches of 2 per rank and step
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "pl")
    extra = ("--global-batch", str(batch), "--checkpoints", "lightning")
    script = "lightning_callback.py"
    procs = [  # side by side: most of a run is start-up
        start_example(script, dataset, ref_dir, 0, ranks, *extra),
        start_example(script, dataset, run_dir, CRASH_AT, ranks, *extra),
    ]
    finish(procs[0])
    out = finish(procs[1])
    assert_kill_reported(out, killed=1)
    assert_same_run(run_dir, ref_dir, STEPS, global_batch=batch)

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    starts = [r for r in records if r["type"] == "job_start"]
    assert [(s["attempt"], s["restored_step"]) for s in starts] == [(0, 0), (1, 8)]
    restores = [r for r in records if r["type"] == "restore"]
    assert restores[1]["path"].endswith("last.ckpt"), restores
    assert _steps_by_attempt(records) == {
        0: list(range(1, CRASH_AT)),
        1: list(range(9, STEPS + 1)),
    }
    steps = [r for r in records if r["type"] == "step"]
    assert all(isinstance(r["loss"], float) and r["tokens"] == batch * 64 for r in steps)
    ckpts = [r for r in records if r["type"] == "checkpoint"]
    assert [r["step"] for r in ckpts] == [4, 8, 12]
    assert all(r["path"].endswith(f"step={r['step']}.ckpt") for r in ckpts), ckpts
    assert [r["step"] for r in steps if r["checkpoint_block_s"] > 0] == [4, 8, 12]
    ends = [r for r in records if r["type"] == "job_end"]
    crash = ends[0]["reason"]  # the broken collective, or torchrun's SIGTERM if first
    assert crash.startswith("error: RuntimeError") or crash == "signal: SIGTERM", crash
    assert ends[1]["reason"] == "finished"

    rep = _report(run_dir, plots=False)
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(0, crash)]
    assert rep["restarts"] == 1
    assert rep["badput"]["restart_gap"] > 0, rep["badput"]
    assert rep["badput"]["startup"] > 0, rep["badput"]
    assert rep["last_step"] == STEPS
    # Lightning loaded last.ckpt before on_train_start: in the start-up, as the table says.
    assert [(r["step"], r["tier"], r["seconds"], r["in_startup"]) for r in rep["restores"]] == [
        (8, "trainer", None, True)
    ]


def _worker(dataset: str, run_dir: str, fail: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        **python(WORKER, dataset, run_dir, "--fail", fail, *extra, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("fail", "reason"),
    [
        ("raise", "error: ValueError: injected failure at step 3"),
        ("sigterm", "signal: SIGTERM"),
        ("setup", "error: ValueError: injected failure in setup"),
    ],
)
def test_lightning_callback_failure_is_a_crash(dataset, tmp_path, fail, reason) -> None:
    """An exception in a step, SIGTERM, and (issue 42) an exception in ``setup``, before
    ``on_train_start`` opened the callback's Run: that one left no ledger at all; now the
    attempt and its crash are recorded (``on_exception``, ``record_failed_start``)."""
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / fail)
    proc = _worker(dataset, run_dir, fail)
    assert fail == "sigterm" or proc.returncode == 1, proc.stderr[-4000:]
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    ends = [r["reason"] for r in records if r["type"] == "job_end"]
    assert ends == [reason], proc.stderr[-4000:]
    starts = [r for r in records if r["type"] == "job_start"]
    assert [(s["attempt"], s["restored_step"]) for s in starts] == [(0, 0)]
    rep = _report(run_dir, plots=False)
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(0, reason)]


def test_a_process_leaving_with_the_strategys_run_open_is_a_crash(dataset, tmp_path) -> None:
    """steadytrain's strategy owns its Run: an exception that escapes Lightning's hooks
    before the strategy's ``on_exception`` (here a user callback's own ``on_exception``
    fails) leaves the interpreter with that Run open. Its ``ExitGuard`` closes it as the
    crash it is, not the meter's clean ``interpreter_exit`` (a crashed attempt the report
    listed as none: seen in CI on a 2-rank strategy run)."""
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / "escape")
    proc = _worker(dataset, run_dir, "escape", "--strategy")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "a user callback's on_exception failed" in proc.stderr, proc.stderr[-4000:]
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    ends = [r["reason"] for r in records if r["type"] == "job_end"]
    assert ends == ["error: RuntimeError: a user callback's on_exception failed"], ends
    rep = _report(run_dir, plots=False)
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(0, ends[0])]


def test_lightning_callback_hang_is_detected(dataset, tmp_path) -> None:
    from steadytrain.monitor.ledger import read_ledger

    run_dir = str(tmp_path / "hang")
    proc = _worker(dataset, run_dir, "hang")
    assert proc.returncode == 124, proc.stderr[-4000:]
    hangs = [r for r in read_ledger(os.path.join(run_dir, "ledger.jsonl")) if r["type"] == "hang"]
    assert hangs and hangs[0]["step"] == 2, hangs


FLOOR_S = 2.0


def test_lightning_validation_longer_than_the_step_deadline_is_no_hang(dataset, tmp_path) -> None:
    """Issue 40: a validation of 2x the step deadline (and of the checkpoint deadline, both
    FLOOR_S) every 4 steps used to end the job with exit 124 inside ``validation_step``. It
    now runs in the declared ``"eval"`` phase under its own deadline (``phases.eval_s``,
    5 x FLOOR_S) and the job finishes.

    Issue 42, same run: ``ModelCheckpoint`` saves on the validated steps, right before each
    validation, and each step accumulates 2 micro-batches. The validations were booked as
    the save's blocking (or the next step's data wait); they are now the ``eval`` bucket,
    the ranks table's data wait holds none of them, the plan takes the saves' own cost, and
    the ledger's loss is the loss ``training_step`` logged (it was that loss / 2)."""
    run_dir = str(tmp_path / "val")
    proc = subprocess.run(
        **python(WORKER, dataset, run_dir, "--fail", "none",
                 "--val-s", str(2 * FLOOR_S), "--floor", str(FLOOR_S), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run_dir, "validations.json")) as f:
        vals = json.load(f)
    assert [v["step"] for v in vals] == [4, 8]
    assert all(v["s"] >= 2 * FLOOR_S for v in vals), vals
    assert_finished_without_hang(run_dir, 8, proc.stderr)
    assert_evaluations_are_eval(run_dir, 0.99 * sum(v["s"] for v in vals), 2 * FLOOR_S)
    with open(os.path.join(run_dir, "losses.json")) as f:
        logged = {int(k): v for k, v in json.load(f).items()}
    from steadytrain.monitor.ledger import read_ledger

    steps = [r for r in read_ledger(os.path.join(run_dir, "ledger.jsonl")) if r["type"] == "step"]
    assert sorted(logged) == [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["loss"] == pytest.approx(logged[r["step"]], rel=1e-6) for r in steps), steps


def test_exact_resume_says_when_the_recipe_is_not_followed(dataset, tmp_path) -> None:
    """Batches that do not come from ``loader.as_dataset()``, a DataLoader with a state of
    its own, Lightning steps that are not the loader's and a resume from a checkpoint that
    holds no loader position each get a warning; the run goes on."""
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    sys.path.insert(0, EXAMPLES)
    from lightning_callback import TinyLM

    from steadytrain import TokenDataset, TokenLoader, TokenWindows
    from steadytrain.integrations.lightning import ExactResume

    ds = TokenDataset.open(dataset)

    def trainer(steps: int, *callbacks: object) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            accumulate_grad_batches=1,
            callbacks=list(callbacks),
            default_root_dir=str(tmp_path),
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    def data() -> StatefulDataLoader:
        return StatefulDataLoader(TokenWindows(ds, 32, labels="next"), batch_size=2)

    first = trainer(2)  # saved without ExactResume
    first.fit(TinyLM(ds.vocab_size), data())
    first.save_checkpoint(str(tmp_path / "plain.ckpt"))
    loader = TokenLoader(ds, seq_len=32, global_batch=4, micro_batch=2)  # 2 per step
    second = trainer(4, ExactResume(loader))
    with pytest.warns(RuntimeWarning) as caught:
        second.fit(TinyLM(ds.vocab_size), data(), ckpt_path=str(tmp_path / "plain.ckpt"))
    said = " | ".join(str(w.message) for w in caught)
    assert "accumulate_grad_batches=1 but the loader makes a step of 2" in said, said
    assert "saves a state of its own" in said, said
    assert "did not come from loader.as_dataset()" in said, said
    assert "resumed at step 2 from a checkpoint that holds no loader position" in said, said
    assert second.global_step == 4
    loader.close()
