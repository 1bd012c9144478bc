"""The planner against ledgers whose failures are known (issue 13, item 4).

``bench/goodput_faults.py`` injects failures the way ``train/faults.py`` does: Poisson in
wall-clock time from the fault injector's first start, taking effect at the next step's
mid-point, and dropped while no process is up to die (a restart's detection and process
start-up). Here ledgers are built on an explicit clock (``steadytrain.testing.synthetic``)
with that mechanism, so the measured goodput is known without running anything, and the
plan measured from each ledger must land on it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from steadytrain.planning import measure_run
from steadytrain.planning.from_run import plan_from_run
from steadytrain.planning.interval import goodput_exact
from steadytrain.planning.montecarlo import simulate
from steadytrain.testing.synthetic import Timeline

STEP, BLOCK, EVERY = 0.75, 0.05, 2  # compute per step, a save's block, steps per save
DEAD, RESTORE, WARM, DETECT = 12.0, 1.0, 7.0, 1.0  # start-up before the injector, ...


def bench_like(run_dir: Path, failures: list[float], steps: int) -> None:
    """A run of ``steps`` steps whose injector sees failures at ``failures`` (seconds from
    its first start); each attempt starts ``DEAD`` s before its injector (imports, joining),
    restores for ``RESTORE`` s, and waits ``WARM`` s in its first step for the other ranks."""
    tl, pending, ckpt = Timeline(t0=0.0), list(failures), 0
    origin = DEAD  # the first injector start
    while True:
        injector = tl.t + DEAD
        while pending and origin + pending[0] <= injector:
            pending.pop(0)  # nobody up to kill: the restart has paid for it already
        fail = origin + pending[0] if pending else float("inf")
        restore = RESTORE if ckpt else 0.0
        tl.job_start(restored_step=ckpt, startup_s=DEAD, restore_s=restore, world_size=2)
        step, warm = ckpt, WARM
        while step < steps:
            mid = tl.t + warm + STEP  # the injector looks after backward
            if fail <= mid:
                break
            step += 1
            save = step % EVERY == 0
            tl.step(step, tokens=512, compute_s=STEP, other_s=warm,
                    checkpoint_block_s=BLOCK if save else 0.0)  # fmt: skip
            if save:  # after its step record, as the async Checkpointer's commit comes
                tl.event({"type": "checkpoint", "step": step, "block_s": BLOCK,
                          "durable_s": BLOCK, "ok": True, "path": "", "error": None})  # fmt: skip
                ckpt = step
            warm = 0.0
        else:
            break
        tl.advance(mid - tl.t + DETECT)  # died at mid; torchrun notices and restarts
    with open(run_dir / "ledger.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in tl.records)


def poisson(seed: int, mtbf: float, n: int = 400) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0 / mtbf)
        out.append(t)
    return out


def test_the_rate_is_over_the_time_attempts_were_up(tmp_path) -> None:
    # Failure 1 after step 10's mid (about 15 s in), failure 2 during the next warm-up.
    bench_like(tmp_path, [15.1, 30.0], steps=20)
    m = measure_run(tmp_path)
    assert m.interruptions == 2
    # Attempt 0: up from its injector (restore 0) to its last step, 7 + 10 x 0.75 + 5 blocks.
    up0 = WARM + 10 * STEP + 5 * BLOCK
    # Attempt 1 died in its warm-up and recorded nothing: it counts half the window from
    # restore start to first step that the others show (WARM, then RESTORE + WARM).
    up1 = (WARM + RESTORE + WARM) / 2 / 2
    # Attempt 2 ran from its restore to the end: 10 steps, 5 saves.
    up2 = RESTORE + WARM + 10 * STEP + 5 * BLOCK
    assert m.exposure_days * 86400 == pytest.approx(up0 + up1 + up2)
    assert m.interruptions_per_day == pytest.approx(2 * 86400 / (up0 + up1 + up2))
    assert m.wall_days > 2 * m.exposure_days  # restarts are most of this run's wall time
    # U: restore and warm-up of the restarted attempt that reached a step; R adds the dead
    # time from the end of each attempt to the next restore start.
    assert m.restart_exposed_s == pytest.approx(RESTORE + WARM)
    assert m.restart_cost_s > m.restart_exposed_s + DEAD
    assert m.first_startup_s == pytest.approx(DEAD + WARM)  # the first step's wait included


@pytest.mark.parametrize("mtbf", [15.0, 40.0])
def test_the_plan_lands_on_the_measured_goodput(tmp_path, mtbf) -> None:
    # Restarts (about 21 s) as long as the time between failures, the regime where the plan
    # used to be 0.29 too high. Long runs: the model is a steady state.
    measured, predicted, old = [], [], []
    for seed in range(8):
        run = tmp_path / f"{mtbf:g}-{seed}"
        run.mkdir()
        bench_like(run, poisson(seed, mtbf), steps=300)
        m = measure_run(run)
        args = {"days": m.total_s / 86400, "interval_min": EVERY * STEP / 60, "simulate_runs": 0}
        plan = plan_from_run(run, measured=m, **args)
        # Before: the rate over wall time, failures hitting the whole restart.
        wall = plan_from_run(run, measured=m, mtbf_hours=m.wall_days * 24 / m.interruptions,
                             restart_cost_s=m.restart_cost_s, **args)  # fmt: skip
        measured.append(m.goodput)
        predicted.append(plan["goodput_exact_run"])
        old.append(wall["goodput_exact_run"])
    mean = sum(measured) / len(measured)
    assert sum(predicted) / len(predicted) == pytest.approx(mean, abs=0.01)
    for p, g in zip(predicted, measured, strict=True):
        assert p == pytest.approx(g, abs=0.03)  # each seed too, with its own rate
    assert sum(old) / len(old) - mean > 0.05  # the old accounting was far off


def test_dead_time_in_the_closed_form_and_the_simulation() -> None:
    tau, c, m, r = 1.5, 0.05, 16.0, 27.0
    classic = goodput_exact(tau, c, m, restart_s=r)
    assert goodput_exact(tau, c, m, restart_s=r, restart_exposed_s=r) == classic
    for u in (0.0, 9.0):
        g = goodput_exact(tau, c, m, restart_s=r, restart_exposed_s=u)
        assert g > classic  # failures that cannot hit the dead time cost less
        sim = simulate(tau, c, m, r, days=0.2, runs=400, seed=1, restart_exposed_s=u)
        assert sim.closed_form_exact == g and sim.exact_agrees, (u, sim.mean, g)
    with pytest.raises(Exception, match="restart_exposed_s"):
        goodput_exact(tau, c, m, restart_s=r, restart_exposed_s=r + 1)
