"""Costs measured from a run's goodput ledger (RUN_DIR/ledger.jsonl; fields in
docs/monitoring.md), in the terms of the planner's model.

The ledger is read through ``monitor`` (``iter_ledger``) and its goodput arithmetic
(``GoodputAccumulator``) in one streaming pass, so the plan and ``steadytrain report`` see
the same records (a torn line is skipped by both) and the same buckets. Each model input
is tied to a bucket:

* ``C`` = mean ``block_s`` of the committed (``ok``) ``checkpoint`` records: one save's share
  of the ``checkpoint_block`` bucket;
* ``L`` = mean ``durable_s`` of the same records (the writer measures it from the start of
  the save, so it includes ``block_s``);
* ``R`` = mean cost of a restart: wall time from the last record of one attempt to the start
  of the first step of the next (``t - step_s`` of that step). Summed over restarts it is the
  ``restart_gap`` bucket plus the ``startup`` and ``restore`` of every attempt after the
  first, plus any wait between ``job_start`` and the first step (which the report counts as
  ``other``). A ledger without restarts gives ``startup_s + restore_s`` of its attempts (plus
  any wait before their first step);
* data stall share ``s`` = ``monitor.goodput.data_stall_share``: the ``data_wait`` bucket
  over the loop's time in steps outside checkpoint blocks;
* lost work per interruption = the ``lost_to_failures`` bucket / interruptions (what the
  model charges as half a period plus ``L - C`` per failure);
* interruptions per day = (attempts - 1) / wall days of the whole job (``total_s`` of the
  breakdown: first process start to the last record).

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
from steadytrain.monitor.goodput import GoodputAccumulator, data_stall_share
from steadytrain.monitor.ledger import LEDGER_NAME, iter_ledger

__all__ = ["RunCosts", "measure_run", "model_badput"]

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
    restart_cost_s: float | None  # R
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_badput(badput_s: dict[str, float], total_s: float) -> dict[str, float]:
    """The report's buckets folded into the plan's terms, as shares of ``total_s``.

    The model has one restart cost ``R``, so ``restart`` = ``startup + restore +
    restart_gap`` (the first attempt's start-up included: a long run amortises it).
    ``other`` (loop overhead, the tail after the last step) has no term in the model.
    """
    folded = {
        "data_wait": badput_s.get("data_wait", 0.0),
        "checkpoint_block": badput_s.get("checkpoint_block", 0.0),
        "restart": sum(badput_s.get(k, 0.0) for k in ("startup", "restore", "restart_gap")),
        "lost_to_failures": badput_s.get("lost_to_failures", 0.0),
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
            self.starts[-1]["first_step"] = t - float(rec.get("step_s") or 0.0)
        elif kind == "checkpoint" and rec.get("ok", True):
            self.blocks.append(float(rec.get("block_s") or 0.0))
            self.durables.append(float(rec.get("durable_s") or 0.0))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _restart_costs(att: _Attempts, summaries: list[dict[str, Any]]) -> list[float]:
    """R of every restart (see module docstring); ``summaries`` are the accumulator's
    attempt summaries, whose ``end_t`` is the attempt's last record."""
    costs = []
    for prev, cur in zip(summaries, att.starts[1:], strict=False):
        first = cur["first_step"] if cur["first_step"] is not None else cur["t0"]
        costs.append(max(0.0, max(first, cur["t0"]) - prev["end_t"]))
    if costs:
        return costs
    # No failure seen: a restart costs at least a start-up and a restore.
    for a in att.starts:
        first = a["first_step"] if a["first_step"] is not None else a["t0"]
        costs.append(a["startup"] + a["restore"] + max(0.0, first - a["t0"]))
    return costs


def measure_run(run_dir: str | os.PathLike[str]) -> RunCosts:
    """Measure C, L, R, the data stall share, the interruption rate and the run's own
    goodput breakdown from ``run_dir/ledger.jsonl`` (one streaming pass)."""
    path = Path(run_dir) / LEDGER_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: --from-run needs a run directory written by steadytrain train "
            "(GoodputMeter), which holds ledger.jsonl"
        )
    acc, att = GoodputAccumulator(), _Attempts()
    for rec in iter_ledger(path):
        acc.add(rec)
        att.add(rec)
    if not att.starts:
        raise ConfigError(
            f"{path} has no job_start record, so it is not a ledger written by GoodputMeter "
            "(lines that are not JSON records were skipped with a warning naming them); "
            "give --from-run the run directory of a steadytrain train run"
        )
    b = acc.breakdown()
    interruptions = b.attempts - 1
    wall_days = b.total_s / 86400.0
    per_day = interruptions / wall_days if interruptions and wall_days > 0 else None
    mean_block, mean_durable = _mean(att.blocks), _mean(att.durables)
    if mean_durable is not None and mean_block is not None:
        mean_durable = max(mean_durable, mean_block)
    world = att.starts[-1]["world_size"]
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
        restart_cost_s=_mean(_restart_costs(att, b.attempt_summaries)),
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
    )
