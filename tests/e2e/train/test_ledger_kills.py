"""Records survive SIGKILL (issue 13): under torchrun with restarts, rank 0 is killed at
seeded random points (mid-step right after a save committed in the background, and while a
save is being written); afterwards the ledger is compared with the checkpoints.

Every attempt restored a committed checkpoint, so the steps between its own restore point
and the next attempt's were trained and checkpointed by it: each must appear among that
attempt's step records, with measured timings (none ``recovered``: in thread mode COMMIT
waits for rank 0's ledger). The meter's writer sleeps 5 s between batches here, so without
that wait every record since the previous commit would still be queued at the kill.

The commit's own ``checkpoint`` record can only follow COMMIT, and a kill right after it
takes that record with it (issue 42: a report then said "0 checkpoints committed" of steps
it restored). The next attempt writes it back (``recovered``, dated by the COMMIT), so every
checkpoint on disk and every one restored is in the ledger.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import ledger, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EVERY = 4  # checkpoint.every_steps in harness.BASE_SETTINGS
STEPS = 20


def committed_steps(ckpt_dir: str) -> list[int]:
    from steadytrain.checkpoint.commit import parse_dirname

    return sorted(
        parse_dirname(name)[0]
        for name in os.listdir(ckpt_dir)
        if parse_dirname(name) and os.path.exists(os.path.join(ckpt_dir, name, "COMMIT"))
    )


def test_every_checkpointed_step_is_in_the_ledger(dataset: str, tmp_path) -> None:
    rng = random.Random(13)
    # Mid-step kills 1-3 steps after a save; the data read of that step first stalls 0.6 s
    # so the save's background write commits before the kill (the case that lost records).
    mid = sorted(rng.sample([s for s in range(5, STEPS) if s % EVERY and s != 12], 2))
    save_kill = rng.choice([s for s in range(EVERY, STEPS, EVERY) if s not in (4,)])
    run_dir, ckpt_dir = str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints")
    kills = ",".join(map(str, mid))
    faults = (
        f"kill_at_steps={kills};slow_read_at_steps={kills};slow_read_s=0.6;"
        f"kill_in_save_at_steps={save_kill};kill_rank=0"
    )
    run_torchrun(
        2,
        [
            f"run_dir={run_dir}",
            f"checkpoint.dir={ckpt_dir}",
            f"data.dataset={dataset}",
            f"train.max_steps={STEPS}",
            "monitor.flush_interval_s=5",
            "monitor.sinks=jsonl",
        ],
        faults=faults,
        max_restarts=4,
    )
    where = f"kills mid-step at {mid}, in the save of step {save_kill}"
    recs = ledger(run_dir)
    assert not [r for r in recs if r.get("recovered") and r["type"] != "checkpoint"], where
    # Every commit is in the ledger, recorded or written back by the attempt that restored it.
    commits = {r["step"]: r for r in recs if r["type"] == "checkpoint" and r.get("ok", True)}
    restores = [r for r in recs if r["type"] == "restore" and r["step"] > 0]
    assert set(committed_steps(ckpt_dir)) | {r["step"] for r in restores} <= set(commits), where
    for r in restores:
        c = commits[r["step"]]
        assert not c.get("recovered") or c["t"] == r["commit_t"], (c, r)
    # Each attempt's step records: between its job_start and the next one.
    attempts: list[dict] = []
    for r in recs:
        if r["type"] == "job_start":
            attempts.append({"restored": r["restored_step"], "steps": set()})
        elif r["type"] == "step":
            attempts[-1]["steps"].add(r["step"])
    assert len(attempts) == 4, (where, [a["restored"] for a in attempts])
    ends = [a["restored"] for a in attempts[1:]] + [STEPS]
    for n, (a, end) in enumerate(zip(attempts, ends, strict=True)):
        missing = set(range(a["restored"] + 1, end + 1)) - a["steps"]
        assert not missing, f"attempt {n} trained and checkpointed {sorted(missing)} ({where})"
    # Against the checkpoints on disk: every step up to the newest committed one is there.
    newest = committed_steps(ckpt_dir)[-1]
    assert newest == STEPS
    assert {r["step"] for r in recs if r["type"] == "step"} >= set(range(1, newest + 1))
    # The kills hit where they were aimed: a restore after a commit made in the background.
    assert any(
        b["restored"] > a["restored"] for a, b in zip(attempts, attempts[1:], strict=False)
    ), where
