"""Costs measured from a run's goodput ledger (RUN_DIR/ledger.jsonl, schema in HELPERS.md).

* ``C`` = mean ``block_s`` of the successful ``checkpoint`` records (what the loop waited);
* ``L`` = mean ``durable_s`` of the same records (the writer measures it from the start of
  the save, so it includes ``block_s``);
* ``R`` = mean cost of a restart: wall time from the last record of one attempt to the start
  of the first step of the next (``t - step_s`` of that step), which covers failure
  detection, rescheduling, ``startup_s`` and ``restore_s``. A ledger without restarts gives
  ``startup_s + restore_s`` of its attempts (plus any wait before their first step);
* data stall share ``s`` = sum ``data_wait_s`` / sum (``step_s - checkpoint_block_s``), the
  share of compute-phase wall time the loop waited for data;
* interruptions per day = (attempts - 1) / wall days from the first process start to the
  last record.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from steadytrain.errors import ConfigError

__all__ = ["RunCosts", "measure_run"]


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
    data_stall_frac: float
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                continue  # a torn last line: the writer crashed mid-record
            raise ConfigError(f"{path}:{n}: not a JSON record ({exc}); is this a ledger?") from exc
        if isinstance(rec, dict) and "type" in rec:
            out.append(rec)
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def measure_run(run_dir: str | os.PathLike[str]) -> RunCosts:
    """Measure C, L, R, the data stall share and the interruption rate of a run."""
    path = Path(run_dir) / "ledger.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: --from-run needs a run directory written by steadytrain train "
            "(GoodputMeter), which holds ledger.jsonl"
        )
    recs = _records(path)
    starts = [r for r in recs if r["type"] == "job_start"]
    if not starts:
        raise ConfigError(f"{path} has no job_start record; it is not a complete ledger")

    attempts: list[dict[str, Any]] = []  # per attempt: start record, first step start, last t
    blocks, durables, waits, busy = [], [], 0.0, 0.0
    steps = 0
    for r in recs:
        t = float(r.get("t") or 0.0)
        kind = r["type"]
        if kind == "job_start":
            attempts.append({"start": r, "t0": t, "first_step": None, "last_t": t})
            continue
        if not attempts:
            continue  # records before the first job_start belong to no attempt
        cur = attempts[-1]
        cur["last_t"] = max(cur["last_t"], t)
        if kind == "step":
            steps += 1
            step_s = float(r.get("step_s") or 0.0)
            if cur["first_step"] is None:
                cur["first_step"] = t - step_s
            waits += float(r.get("data_wait_s") or 0.0)
            busy += max(0.0, step_s - float(r.get("checkpoint_block_s") or 0.0))
        elif kind == "checkpoint" and r.get("ok", True):
            blocks.append(float(r.get("block_s") or 0.0))
            durables.append(float(r.get("durable_s") or 0.0))

    def setup(a: dict[str, Any]) -> tuple[float, float]:
        return float(a["start"].get("startup_s") or 0.0), float(a["start"].get("restore_s") or 0.0)

    restarts, gaps = [], []
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        su, rs = setup(cur)
        began = cur["t0"] - su - rs  # process start of the next attempt
        first = cur["first_step"] if cur["first_step"] is not None else cur["t0"]
        gaps.append(max(0.0, began - prev["last_t"]))
        restarts.append(max(0.0, max(first, cur["t0"]) - prev["last_t"]))
    if not restarts:  # no failure seen: a restart costs at least a start-up and a restore
        for a in attempts:
            su, rs = setup(a)
            first = a["first_step"] if a["first_step"] is not None else a["t0"]
            restarts.append(su + rs + max(0.0, first - a["t0"]))

    su_all = [setup(a)[0] for a in attempts]
    rs_all = [setup(a)[1] for a in attempts]
    su0, rs0 = setup(attempts[0])
    t_begin = attempts[0]["t0"] - su0 - rs0
    t_end = max(a["last_t"] for a in attempts)
    wall_days = max(0.0, t_end - t_begin) / 86400.0
    interruptions = len(attempts) - 1
    per_day = interruptions / wall_days if interruptions and wall_days > 0 else None
    mean_block = _mean(blocks)
    mean_durable = _mean(durables)
    if mean_durable is not None and mean_block is not None:
        mean_durable = max(mean_durable, mean_block)
    return RunCosts(
        ledger=str(path),
        attempts=len(attempts),
        world_size=int(attempts[-1]["start"]["world_size"])
        if attempts[-1]["start"].get("world_size")
        else None,
        interruptions=interruptions,
        wall_days=wall_days,
        interruptions_per_day=per_day,
        checkpoints=len(blocks),
        ckpt_cost_s=mean_block,
        durable_s=mean_durable,
        restart_cost_s=_mean(restarts),
        restart_gap_s=_mean(gaps),
        startup_s=_mean(su_all) or 0.0,
        restore_s=_mean(rs_all) or 0.0,
        data_stall_frac=min(waits / busy, 0.99) if busy > 0 else 0.0,
        steps=steps,
    )
