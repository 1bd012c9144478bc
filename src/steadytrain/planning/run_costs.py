"""Costs measured from a run's goodput ledger (RUN_DIR/ledger.jsonl; fields in
docs/monitoring.md), in the terms of the planner's model.

The ledger is read through ``monitor`` (``iter_ledger``) and its goodput arithmetic
(``GoodputAccumulator``) in one streaming pass, then charged as the report charges it
(``report.build.run_breakdown``: a slower rank's waits from the rank files and the
diagnosis), so the plan and ``steadytrain report`` see the same records (a torn line is
skipped by both), the same buckets and the same goodput. Each model input is tied to a
bucket:

* ``C`` = mean ``block_s`` of the committed (``ok``) ``checkpoint`` records: one save's share
  of the ``checkpoint_block`` bucket (never an evaluation beside it: the trainer callbacks
  time a save on ``Run.clock``, which stops inside the ``eval`` phase);
* ``L`` = mean ``durable_s`` of the same records (the writer measures it from the start of
  the save, so it includes ``block_s``);
* an attempt is *up* (exposed to failures) from the start of its restore (``job_start.t -
  restore_s``: its processes have started and joined, the point where the fault injector of
  ``train/faults.py`` starts too) until it fails. Its last record marks that end when it
  recorded a step; an attempt that died before its first step (in its warm-up) recorded
  nothing after ``job_start``, and is taken to have failed halfway through the warm-up
  that the other attempts show (at most until the next process started);
* ``R`` = mean cost of a restart = ``D + U``: the dead time ``D`` from the end of one
  attempt (above) to the restore start of the next (detection, rescheduling, process
  start-up: no failure can hit it, the job is down), plus the exposed warm-up ``U`` from the
  restore start to the start of the first step's work (restore, waiting for the other
  ranks: the first step's ``step_s`` beyond its compute, data wait and block is warm-up,
  not loop overhead). For a ledger whose attempts all recorded steps, ``R`` summed over
  restarts is the ``restart_gap`` bucket plus the ``startup`` and ``restore`` of every
  attempt after the first, plus that warm-up. A ledger without restarts gives each
  attempt's start-up, restore and warm-up;
  When every restart of the run recorded its start-up in phases (``Run``, issue 44), ``R`` is
  instead the mean of the restarts' phase sums (``report/restarts.py``: detection, teardown,
  relaunch, imports, build, group, set-up, restore, the first step's excess), and ``U`` the
  mean of their restore and first-step excess (the part after the restore began);
  ``restart_phases_s`` gives the mean of each phase, so a plan says which phase to shorten;
* data stall share ``s`` = ``monitor.goodput.data_stall_share``: the ``data_wait``,
  ``slowdown`` and straggler buckets over the loop's time in steps outside checkpoint
  blocks;
* lost work per interruption = the ``lost_to_failures`` bucket / interruptions (what the
  model charges as half a period plus ``L - C`` per failure);
* interruptions per day = (attempts - 1) / days the attempts were up (``exposure_days``,
  above): failures strike running jobs, so time spent down does not dilute the rate (it
  did: with restarts as long as the time between failures, a rate over wall time came out
  at half the real one). With its exact 95 % Poisson interval (``interruptions_per_day_ci``;
  a handful of failures pins the rate down only loosely);
* the first start-up ``S0`` = process start to the first step's work of the first attempt:
  paid once per run, outside the model's steady state (``plan`` charges it to a run of
  ``--days``).

Why not the meter's snapshot (``ledger.snapshot.json``): it holds only the accumulator's
state, while ``C``, ``L`` and ``R`` need the checkpoint and restart records themselves; the
pass is streaming (memory independent of the run's length), like the report's.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.monitor.goodput import GoodputAccumulator, data_stall_share, productive_s
from steadytrain.monitor.ledger import LEDGER_NAME, iter_ledger
from steadytrain.monitor.records_lost import LostSpans
from steadytrain.planning.failures import rate_interval
from steadytrain.report.build import run_breakdown
from steadytrain.report.restarts import PHASES

__all__ = ["RunCosts", "measure_run", "model_badput", "phase_means"]

# The model's ``s`` must stay below 1 (a loop that only waits has no interval to plan).
MAX_STALL_FRAC = 0.99


@dataclass
class RunCosts:
    ledger: str
    attempts: int
    world_size: int | None
    interruptions: int
    wall_days: float
    interruptions_per_day: float | None  # None when the ledger shows no interruption
    checkpoints: int
    ckpt_cost_s: float | None  # C
    durable_s: float | None  # L
    restart_cost_s: float | None  # R = D + U
    restart_gap_s: float | None  # the part of R outside any process (detection, queueing)
    startup_s: float
    restore_s: float
    data_stall_frac: float  # s
    steps: int
    # The run's own goodput and badput (monitor.goodput.Breakdown), for the plan to set the
    # model's prediction against.
    goodput: float
    total_s: float
    badput_s: dict[str, float]  # the report's buckets, seconds
    badput: dict[str, float]  # shares of total_s in the plan's terms (``model_badput``)
    steps_lost: int
    lost_per_interruption_s: float | None  # lost_to_failures / interruptions
    # The rate's exact 95 % interval (0 interruptions: [0, upper]); None for an empty run.
    interruptions_per_day_ci: list[float] | None = None
    first_startup_s: float = 0.0  # S0: the first attempt's start-up and warm-up
    restart_exposed_s: float | None = None  # U: the part of R failures can hit
    exposure_days: float = 0.0  # days the attempts were up: the rate's denominator
    # The mean of each restart phase (report/restarts.py) when every restart has them
    restart_phases_s: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_badput(badput_s: dict[str, float], total_s: float) -> dict[str, float]:
    """The report's buckets folded into the plan's terms, as shares of ``total_s``.

    The model has one restart cost ``R``, so ``restart`` = ``startup + restore +
    restart_gap`` (the first attempt's start-up included: a long run amortises it).
    ``eval`` (evaluation) and ``other`` (loop overhead, the tail after the last step) have no
    term in the model: they are shown so the run's goodput can be read against the plan's.
    """
    folded = {
        "data_wait": badput_s.get("data_wait", 0.0),
        "checkpoint_block": badput_s.get("checkpoint_block", 0.0),
        "restart": sum(badput_s.get(k, 0.0) for k in ("startup", "restore", "restart_gap")),
        # Steps slowed beside a background write: the model charges it with the data wait
        # in its stall share ``s`` (monitor.goodput.data_stall_share).
        "slowdown": badput_s.get("slowdown", 0.0),
        # Waiting for a slower rank (the report's charges): in the stall share too.
        "straggler": badput_s.get("straggler_wait", 0.0) + badput_s.get("straggler_compute", 0.0),
        "lost_to_failures": badput_s.get("lost_to_failures", 0.0),
        "eval": badput_s.get("eval", 0.0),
        "other": badput_s.get("other", 0.0),
    }
    return {k: (v / total_s if total_s > 0 else 0.0) for k, v in folded.items()}


class _Attempts:
    """What the cost model needs beyond the accumulator's buckets: per attempt the
    ``job_start`` time, start-up, restore and the start of its first step; per committed
    save its block and durable times."""

    def __init__(self) -> None:
        self.starts: list[dict[str, Any]] = []
        self.blocks: list[float] = []
        self.durables: list[float] = []

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        t = float(rec.get("t") or 0.0)
        if kind == "job_start":
            self.starts.append(
                {
                    "t0": t,
                    "startup": float(rec.get("startup_s") or 0.0),
                    "restore": float(rec.get("restore_s") or 0.0),
                    "world_size": rec.get("world_size"),
                    "first_step": None,
                }
            )
        elif not self.starts:
            return  # records before the first job_start belong to no attempt
        elif kind == "step" and self.starts[-1]["first_step"] is None:
            # Where the first step's work began: what its step_s holds beyond compute, data
            # wait, evaluation and block is the attempt's warm-up (the other ranks starting).
            work = productive_s(rec) + float(rec.get("data_wait_s") or 0.0)
            work += float(rec.get("eval_s") or 0.0)
            self.starts[-1]["first_step"] = t - work - float(rec.get("checkpoint_block_s") or 0)
        elif kind == "checkpoint" and rec.get("ok", True) and not rec.get("recovered"):
            # a commit written back at the next start has no measured costs (recovered.py)
            self.blocks.append(float(rec.get("block_s") or 0.0))
            self.durables.append(float(rec.get("durable_s") or 0.0))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class _Exposure:
    """The up-time split of a ledger's attempts (module docstring)."""

    up_s: float  # sum over attempts of restore start to failure (or to the last record)
    dead: list[float]  # D of each restart
    warmup: list[float]  # U of each attempt that reached a step: restore start to work
    first_startup_s: float  # S0


def _exposure(att: _Attempts, summaries: list[dict[str, Any]]) -> _Exposure:
    ups = [a["t0"] - a["restore"] for a in att.starts]  # restore starts
    births = [a["t0"] - a["restore"] - a["startup"] for a in att.starts]
    warm = [
        a["first_step"] - up
        for a, up in zip(att.starts, ups, strict=True)
        if a["first_step"] is not None
    ]
    half = max(0.0, sum(warm) / len(warm)) / 2 if warm else 0.0
    ends = []
    for i, (a, s) in enumerate(zip(att.starts, summaries, strict=False)):
        end = s["end_t"]
        if a["first_step"] is None and i + 1 < len(att.starts):
            # Died in its warm-up: nothing recorded; the failure fell somewhere inside it.
            end = max(end, min(ups[i] + half, births[i + 1]))
        ends.append(end)
    dead = [max(0.0, up - end) for up, end in zip(ups[1:], ends, strict=False)]
    first = att.starts[0]
    work = first["first_step"] if first["first_step"] is not None else first["t0"]
    return _Exposure(
        up_s=sum(max(0.0, end - up) for up, end in zip(ups, ends, strict=False)),
        dead=dead,
        warmup=[max(0.0, w) for w in warm],
        first_startup_s=max(0.0, work - births[0]),
    )


def _restart_cost(e: _Exposure, att: _Attempts) -> tuple[float | None, float | None]:
    """(R, U): R = mean D + U over restarts, U = mean warm-up of the restarted attempts
    that reached a step (of all attempts when none did)."""
    restarted = [
        a["first_step"] - (a["t0"] - a["restore"])
        for a in att.starts[1:]
        if a["first_step"] is not None
    ]
    warm = _mean(restarted) if restarted else _mean(e.warmup)
    if e.dead:
        u = warm if warm is not None else 0.0
        return sum(e.dead) / len(e.dead) + u, u
    # No failure seen: a restart costs at least a start-up, a restore and a warm-up.
    costs = [
        a["startup"]
        + a["restore"]
        + max(0.0, (a["t0"] if a["first_step"] is None else a["first_step"]) - a["t0"])
        for a in att.starts
    ]
    return _mean(costs), warm


def measure_run(run_dir: str | os.PathLike[str]) -> RunCosts:
    """Measure C, L, R, the data stall share, the interruption rate and the run's own
    goodput breakdown from ``run_dir/ledger.jsonl`` (one streaming pass)."""
    path = Path(run_dir) / LEDGER_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: --from-run needs a run directory written by steadytrain train "
            "(GoodputMeter), which holds ledger.jsonl"
        )
    acc, att, lost = GoodputAccumulator(), _Attempts(), LostSpans()
    starts: list[dict[str, Any]] = []
    # Invalid records (monitor/records.py) are skipped with a warning naming the line.
    for rec in iter_ledger(path):
        acc.add(rec)
        att.add(rec)
        lost.add(rec)
        if rec.get("type") == "job_start":
            starts.append(rec)
    if not att.starts:
        raise ConfigError(
            f"{path} has no job_start record, so it is not a ledger written by GoodputMeter "
            "(lines that are not JSON records were skipped with a warning naming them); "
            "give --from-run the run directory of a steadytrain train run"
        )
    # The report's breakdown (steadytrain.report.build.run_breakdown): rank 0's ledger
    # with what only the rank files and the diagnosis see charged (a slower rank's data or
    # compute), so the run's goodput here is the one the report prints.
    restarts: list[dict[str, Any]] = []
    b = run_breakdown(run_dir, acc.breakdown(), lost.spans, restarts=restarts)
    interruptions = b.attempts - 1
    wall_days = b.total_s / 86400.0
    e = _exposure(att, b.attempt_summaries)
    up_days = e.up_s / 86400.0
    per_day = interruptions / up_days if interruptions and up_days > 0 else None
    mean_block, mean_durable = _mean(att.blocks), _mean(att.durables)
    if mean_durable is not None and mean_block is not None:
        mean_durable = max(mean_durable, mean_block)
    world = att.starts[-1]["world_size"]
    ci = list(rate_interval(interruptions, up_days)) if up_days > 0 else None
    restart, exposed = _restart_cost(e, att)
    phases = phase_means(restarts)
    if phases is not None:
        restart = sum(phases.values())
        exposed = phases.get("restore_s", 0.0) + phases.get("first_step_excess_s", 0.0)
    return RunCosts(
        ledger=str(path),
        attempts=b.attempts,
        world_size=int(world) if world else None,
        interruptions=interruptions,
        wall_days=wall_days,
        interruptions_per_day=per_day,
        checkpoints=len(att.blocks),
        ckpt_cost_s=mean_block,
        durable_s=mean_durable,
        restart_cost_s=restart,
        restart_gap_s=b.badput_s["restart_gap"] / interruptions if interruptions else None,
        startup_s=b.badput_s["startup"] / b.attempts,
        restore_s=b.badput_s["restore"] / b.attempts,
        data_stall_frac=min(data_stall_share(b), MAX_STALL_FRAC),
        steps=b.steps_recorded,
        goodput=b.goodput,
        total_s=b.total_s,
        badput_s=dict(b.badput_s),
        badput=model_badput(b.badput_s, b.total_s),
        steps_lost=b.steps_lost,
        lost_per_interruption_s=(
            b.badput_s["lost_to_failures"] / interruptions if interruptions else None
        ),
        interruptions_per_day_ci=ci,
        first_startup_s=e.first_startup_s,
        restart_exposed_s=exposed,
        exposure_days=up_days,
        restart_phases_s=phases,
    )


def phase_means(restarts: list[dict[str, Any]]) -> dict[str, float] | None:
    """The mean seconds of each restart phase over ``restarts`` (the report's rows), or None
    unless every one has its start-up in phases and its first step's excess (a ledger
    written before them, or a restart into a one-step attempt, keeps the older ``R``). A
    phase one restart lacks (``undivided_s`` beside the divided gap of another) counts 0
    there."""
    if not restarts or any(
        "imports_s" not in r["phases"] or "first_step_excess_s" not in r["phases"] for r in restarts
    ):
        return None
    names = [k for k in PHASES if any(k in r["phases"] for r in restarts)]
    return {k: sum(r["phases"].get(k, 0.0) for r in restarts) / len(restarts) for k in names}
