"""``steadytrain plan --two-tier``: both intervals, from measured costs, at reference rates.

``two_tier_section(plan, ...)`` adds the memory tier to a plan made by ``plan_from_run``: the
durable tier's costs (``C``, ``L``, ``R``, ``s``) are the plan's own, so the durable-only
column is the plan's model with the tier off; the memory tier's come, each in this order,
from the caller, from the run (``measure_tiers``: its ``memory_snapshot`` and ``restore``
records), or from the defaults below, and ``sources`` says which. It answers at the plan's
failure rate and at the reference rates (``SCENARIOS``): the seeds' cluster (1 % failures
per GPU-year on 256 and on 1,024 GPUs) and Llama 3 405B's (466 interruptions in 54 days on
16,384 GPUs), so one command sets two tiers against durable-only at all of them.

Defaults (each marked "default" in ``sources``, and named in the notes):

* step ``t`` = 6 s: Llama 3 405B's step (16M-token batches, ``6 x 405e9 x 16e6`` FLOPs on
  16,384 GPUs at ~400 TFLOP/s);
* snapshot blocking ``c_m`` = 0.5 s: DLRover's flash checkpoint to shared memory
  (../shared/ANCHORS-resilience.md, section 3); the generation is taken to be usable when
  the blocking ends unless the run measured its write and peer copy;
* memory restore ``r_m`` = 10 s ("from host memory it is seconds", ibid., section 4);
* durable restore ``r_d`` = half the restart cost (it is part of ``R``);
* ``f`` = 0.75: DLRover, ~75 % of faults were fixed by a process restart, host memory
  surviving (ibid.); a lost node with a live peer counts too, so this is conservative.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.monitor.ledger import LEDGER_NAME, iter_ledger
from steadytrain.planning.failures import LLAMA3_INTERRUPTIONS_PER_DAY, FailureModel
from steadytrain.planning.two_tier import TierCosts, recommend
from steadytrain.report.restores import RestoreLog

__all__ = ["DEFAULTS", "SCENARIOS", "measure_tiers", "two_tier_section"]

DEFAULTS = {
    "step_s": 6.0,
    "memory_cost_s": 0.5,
    "memory_restore_s": 10.0,
    "survives": 0.75,
}
# (name, what it is, its failure rate)
SCENARIOS = (
    (
        "seeds 256",
        "the seeds' cluster, 256 GPUs at 1 % failures per GPU-year",
        FailureModel.from_afr(256, 0.01),
    ),
    (
        "seeds 1024",
        "the seeds' cluster, 1,024 GPUs at 1 % failures per GPU-year",
        FailureModel.from_afr(1024, 0.01),
    ),
    (
        "Llama 3 405B",
        "466 interruptions (419 unexpected) in 54 days on 16,384 H100 GPUs",
        FailureModel.from_interruptions_per_day(LLAMA3_INTERRUPTIONS_PER_DAY),
    ),
)
_MEMORY_TIERS = ("local-memory", "peer-memory")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def measure_tiers(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The memory tier's costs as a run measured them (None where it did not):

    ``step_s``: mean ``step_s - checkpoint_block_s`` of the step records (a step without its
    saves); ``memory_cost_s``: what a snapshot cost the loop, when the run measured it
    (``every_steps = "auto"``: the newest record's ``auto.cost_s``, its blocking plus how
    much the steps its generation overlapped lost), else the mean ``block_s`` of the
    ``memory_snapshot`` records, refused ones too (they blocked; this leaves out what the
    background work took from the step); ``memory_cost_from``: which; ``memory_landed_s``: mean ``block_s + write_s + peer_s`` of the
    ok ones (the generation is usable once its peer copy is in); ``memory_restore_s`` and
    ``durable_restore_s``: mean ``restore_s`` of the restores from memory (either tier) and
    from durable storage (``report.restores``: the rows ``report`` prints);
    ``survives``: the share of restores that came from memory, only when the tier was on
    (the run has snapshot records) and something was restored."""
    path = Path(run_dir) / LEDGER_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: --from-run needs a run directory written by steadytrain train "
            "(GoodputMeter), which holds ledger.jsonl"
        )
    log = RestoreLog()
    steps: list[float] = []
    blocks: list[float] = []
    landed: list[float] = []
    whole_cost: float | None = None  # the tier's own measurement ("auto"), newest
    for rec in iter_ledger(path):  # invalid records skipped and counted, as for the report
        log.add(rec)
        kind = rec["type"]
        if kind == "step" and rec.get("step_s") is not None:
            steps.append(max(0.0, rec["step_s"] - (rec.get("checkpoint_block_s") or 0.0)))
        elif kind == "memory_snapshot":
            block = rec.get("block_s") or 0.0
            blocks.append(block)
            auto = rec.get("auto")
            if isinstance(auto, dict) and isinstance(auto.get("cost_s"), (int, float)):
                whole_cost = float(auto["cost_s"])
            if rec.get("ok", True) is not False:
                landed.append(block + (rec.get("write_s") or 0.0) + (rec.get("peer_s") or 0.0))
    rows = log.rows()
    memory = [r["seconds"] for r in rows if r["tier"] in _MEMORY_TIERS]
    durable = [r["seconds"] for r in rows if r["tier"] == "durable"]
    step_s = _mean(steps)
    return {
        "step_s": step_s if step_s else None,
        "memory_cost_s": whole_cost if whole_cost is not None else _mean(blocks),
        "memory_cost_from": (
            "auto.cost_s" if whole_cost is not None else "block_s" if blocks else None
        ),
        "memory_landed_s": _mean(landed),
        "memory_restore_s": _mean(memory),
        "durable_restore_s": _mean(durable),
        "survives": len(memory) / len(rows) if rows and blocks else None,
        "snapshots": len(blocks),
        "restores": {t: sum(r["tier"] == t for r in rows) for t in (*_MEMORY_TIERS, "durable")},
    }


def two_tier_section(
    plan: dict[str, Any],
    *,
    measured: dict[str, Any] | None = None,
    step_s: float | None = None,
    memory_cost_s: float | None = None,
    memory_restore_s: float | None = None,
    durable_restore_s: float | None = None,
    survives: float | None = None,
    in_place_share: float = 0.0,
    in_place_s: float = 0.0,
) -> dict[str, Any]:
    """The ``two_tier`` key of ``plan --json`` (module docstring). ``plan``: what
    ``plan_from_run`` returned; ``measured``: ``measure_tiers`` of its run, or None;
    ``in_place_share`` of the failures recovered in place at ``in_place_s`` each
    (``TierCosts``; ``plan --in-place-share``)."""
    m = measured or {}
    src: dict[str, str] = {}
    notes: list[str] = []

    def pick(name: str, given: float | None, default: float | None) -> float | None:
        for value, how in ((given, "given"), (m.get(name), "measured")):
            if value is not None:
                src[name] = how
                return float(value)
        src[name] = "default"
        return default

    t = pick("step_s", step_s, DEFAULTS["step_s"])
    c_m = pick("memory_cost_s", memory_cost_s, DEFAULTS["memory_cost_s"])
    # A measured landing time belongs to the measured blocking, not to a given one.
    landed = m.get("memory_landed_s") if src["memory_cost_s"] == "measured" else None
    r_m = pick("memory_restore_s", memory_restore_s, DEFAULTS["memory_restore_s"])
    r_d = pick("durable_restore_s", durable_restore_s, plan["restart_cost_s"] / 2.0)
    f = pick("survives", survives, DEFAULTS["survives"])
    assumed = [k for k, how in src.items() if how == "default"]
    if assumed:
        notes.append(
            "assumed "
            + ", ".join(
                f"{k}={v:g}"
                for k, v in (
                    ("step_s", t),
                    ("memory_cost_s", c_m),
                    ("memory_restore_s", r_m),
                    ("durable_restore_s", r_d),
                    ("survives", f),
                )
                if k in assumed
            )  # fmt: skip
            + " (docs/planning.md, 'Two tiers'; give them with --step-time, --memory-cost, "
            "--memory-restore, --durable-restore, --memory-survives)"
        )
    if r_d > plan["restart_cost_s"]:
        notes.append(
            f"durable restore {r_d:g} s is more than the whole restart {plan['restart_cost_s']:g}"
            " s it is part of: the restart from memory is taken as the memory restore alone"
        )
    costs = TierCosts(
        step_s=t,
        memory_cost_s=c_m,
        memory_landed_s=landed,
        memory_restore_s=r_m,
        durable_cost_s=plan["ckpt_cost_s"],
        durable_s=plan["durable_s"],
        restart_s=plan["restart_cost_s"],
        durable_restore_s=r_d,
        survives=f,
        stall_frac=plan["data_stall_frac"],
        in_place_share=in_place_share,
        in_place_s=in_place_s,
    )
    here = recommend(costs, plan["mtbf_hours"] * 3600.0)
    scenarios = [
        {
            "name": name,
            "description": what,
            "interruptions_per_day": fm.interruptions_per_day,
            **recommend(costs, fm.mtbf_s),
        }
        for name, what, fm in SCENARIOS
    ]
    if here["memory_every_steps"] is not None:
        notes.append(
            f"set [checkpoint.memory] every_steps = {here['memory_every_steps']} and the "
            f"durable interval to {here['durable_interval_min']:.3g} min"
            if here["durable_interval_min"] is not None
            else f"set [checkpoint.memory] every_steps = {here['memory_every_steps']}; every "
            "failure here is survived by memory: save durably for the run's end and for "
            "layout changes only"
        )
    else:
        notes.append("the memory tier does not pay at these costs (checkpoint.memory off)")
    return {
        "costs": costs.to_dict(),
        "sources": src,
        "measured": measured,
        **here,
        "scenarios": scenarios,
        "notes": notes,
    }
