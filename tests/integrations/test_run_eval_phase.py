"""A rank-0-only evaluation inside ``run.phase("eval")`` under the real torchrun, 2 gloo
ranks (``plain_worker.py``), the two runs side by side (issue 40, "never kill a healthy
rank"). Every EVERY steps rank 0 evaluates for 2 x the step deadline (FLOOR_S) while rank 1
goes on and waits for it in the next step's gradient all-reduce, under its own 2 s step
deadline:

- (a) the job finishes with no hang and no kill: rank 1 past its deadline reads rank 0's
  published phase and waits for it, and rank 0's phase has its own deadline (EVAL_S). It
  used to end with rank 0 named "no response" and SIGKILLed by its own reaper, or (with
  no deadline of its own) fired by rank 0's own watchdog inside the evaluation;
- (b) the same with rank 1 SIGSTOPped inside the evaluation is still a hang, found at the
  eval deadline and not before: rank 0 waits out rank 1's declared phase, then names
  rank 1 ("no response"), whose reaper kills it; the ``hang`` record says which phase's
  deadline fired and whose; torchrun restarts the job, which finishes.
"""

from __future__ import annotations

import json
import os

import pytest
from example_runs import finish
from test_run_plain_pytorch import start

from steadytrain.monitor.ledger import read_ledger

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FLOOR_S = 2.0  # the step deadline
EVAL_S = 4 * FLOOR_S  # the eval phase's own deadline
EVERY = 3  # steps between evaluations (steps 3 and 6 of 8)
STOP_AT = 6  # (b): rank 1 stops inside the evaluation after step 6


def _args(*extra: str) -> list[str]:
    return ["--steps", "8", "--watchdog-floor", str(FLOOR_S), "--eval-every", str(EVERY),
            "--eval-s", str(2 * FLOOR_S), "--eval-deadline", str(EVAL_S), *extra]  # fmt: skip


def test_an_evaluation_on_one_rank_holds_the_job_and_a_stop_inside_it_is_found(
    dataset: str, tmp_path
) -> None:
    ok, stopped = str(tmp_path / "ok"), str(tmp_path / "stopped")
    procs = [
        start(dataset, ok, *_args()),
        start(dataset, stopped, *_args("--stop-in-eval", str(STOP_AT))),
    ]
    outs = [finish(p) for p in procs]

    # -- (a) no kill: the job finished in one attempt, nothing fired ------------------------
    recs = read_ledger(os.path.join(ok, "ledger.jsonl"))
    assert not [r for r in recs if r["type"] == "hang"], outs[0][-4000:]
    assert [r["type"] for r in recs].count("job_start") == 1
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
    assert max(r["step"] for r in recs if r["type"] == "step") == 8
    assert "[watchdog]" not in outs[0] and "[reaper]" not in outs[0], outs[0][-4000:]
    assert not os.path.exists(os.path.join(ok, "hangs", "attempt-0"))
    # Rank 0 published its evaluation; it lasted 2 x the step deadline.
    with open(os.path.join(ok, "hangs", "phases", "attempt-0", "phase-rank-0.json")) as f:
        phase = json.load(f)
    assert phase["phase"] == "eval" and phase["state"] == "closed"
    assert phase["closed_t"] - phase["entered_t"] >= 2 * FLOOR_S
    assert phase["deadline_s"] == EVAL_S
    # Issue 42: rank 0's ledger books each evaluation as the next step's eval_s (the eval
    # bucket), never as its compute, data wait or checkpoint block.
    steps = {r["step"]: r for r in recs if r["type"] == "step"}
    after_eval = (EVERY + 1, 2 * EVERY + 1)  # the steps after each evaluation
    for s in after_eval:
        r = steps[s]
        assert r["eval_s"] >= 2 * FLOOR_S, r
        assert r["data_wait_s"] + r["compute_s"] + r["checkpoint_block_s"] <= (
            r["step_s"] - r["eval_s"] + 1e-6
        ), r
    assert all(r["eval_s"] == 0 for s, r in steps.items() if s not in after_eval), steps

    # -- (b) rank 1 stopped inside the evaluation: a hang at the eval deadline -------------
    recs = read_ledger(os.path.join(stopped, "ledger.jsonl"))
    starts = [r for r in recs if r["type"] == "job_start"]  # torchrun restarted it once
    assert [s["restored_step"] for s in starts] == [0, 4] and recs[-1]["reason"] == "finished"
    hangs = [r for r in recs if r["type"] == "hang"]
    assert len(hangs) == 1, outs[1][-4000:]
    h = hangs[0]
    assert h["stuck_ranks"] == [1] and h["missing_ranks"] == [1], h
    assert h["cause"] == "no response" and h["step"] == STOP_AT
    assert (h["phase"], h["phase_rank"], h["deadline_s"]) == ("eval", 1, EVAL_S), h
    d = os.path.join(stopped, "hangs", "attempt-0")
    with open(os.path.join(d, "rank-0.json")) as f:
        held = json.load(f)["held_by"]
    # Rank 0 waited out rank 1's declared phase: its deadline from rank 1's last progress.
    assert held["rank"] == 1 and held["phase"] == "eval" and held["closed_t"] is None
    assert held["until_t"] == pytest.approx(held["progress_t"] + EVAL_S)
    assert h["detect_t"] >= held["until_t"]  # not before the eval deadline...
    assert h["detect_t"] - held["until_t"] < EVAL_S  # ...and at about it
    assert h["progress_t"] == held["progress_t"]  # the job's last progress: rank 1's
    with open(os.path.join(d, "reaped-rank-1.json")) as f:
        reaped = json.load(f)
    assert reaped["proc_state"] == "T" and reaped["rank"] == 1, reaped
