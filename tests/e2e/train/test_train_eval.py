"""The reference loop's evaluation (``train.eval_every``, ``train.eval_batches``) under the
real torchrun, 2 gloo ranks: every 3 steps both ranks compute the loss of their fixed
sample (train/evaluation.py) and rank 0 prints the mean. Evaluating moves nothing of
training: the per-step losses and the final weights are bit-identical to the same run
without it, and the job finishes in one attempt with no hang."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import final, ledger, read_trace, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS, EVERY, BATCHES = 8, 3, 4


def test_evaluation_runs_every_n_steps_and_moves_nothing_of_training(
    dataset: str, tmp_path
) -> None:
    runs = {}
    for name, extra in (("eval", [f"train.eval_every={EVERY}",
                                   f"train.eval_batches={BATCHES}"]), ("plain", [])):  # fmt: skip
        run_dir = str(tmp_path / name)
        settings = [f"data.dataset={dataset}", f"run_dir={run_dir}",
                    f"train.max_steps={STEPS}", *extra]  # fmt: skip
        runs[name] = (run_dir, run_torchrun(2, settings))
    run_dir, done = runs["eval"]
    evals = re.findall(r"eval at step (\d+): loss ([\d.]+)", done.stdout + done.stderr)
    assert [int(s) for s, _ in evals] == [3, 6], done.stdout[-3000:]
    assert all(0 < float(loss) < 20 for _, loss in evals)
    # The sample is fixed and the model learns between evaluations: the two losses differ.
    assert evals[0][1] != evals[1][1]
    recs = ledger(run_dir)
    assert [r["type"] for r in recs].count("job_start") == 1
    assert not [r for r in recs if r["type"] == "hang"]

    def losses(d: str) -> list[tuple[int, int, float]]:
        return sorted((r["rank"], r["step"], r["loss"]) for r in read_trace(d))

    plain = runs["plain"][0]
    assert losses(run_dir) == losses(plain) and len(losses(plain)) == 2 * STEPS
    assert final(run_dir)["weights"] == final(plain)["weights"]
