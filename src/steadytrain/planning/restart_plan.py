"""The restart in phases, in the plan (issue 44): ``plan --two-tier --restart-phases`` and
``--scale-to-gpus N``.

A restart's cost ``R`` is the sum of its phases (``report.restarts.PHASES``: detection,
teardown, relaunch, imports, build, group, set-up, restore, the first step's excess); the
restore phase is the restore from storage ``r_d``, which a restart from memory replaces by
``r_m``. A share ``q`` of the failures (process faults on a live node) is recovered in place
at ``in_place_s`` (``TierCosts.in_place_share``): those pay none of the phases. So one
failure costs, on average (the memory snapshot newer than the durable save, as
``two_tier.evaluate`` decides)::

    (1 - q) * sum(phases other than restore) + (f - q) r_m + (1 - f) r_d + q * in_place_s

and ``breakdown`` charges each term, times ``lambda`` and the training share, to its phase:
with the data stall, both tiers' blocking and the lost work the points add up to ``1 - G``.

``goal`` answers "what would 98 % take": the factor every whole-restart phase must shrink by
(the intervals chosen again at each step), the goodput with free restarts (the floor the
phases cannot lift), and the share of failures that would have to be recovered in place.

``scaled_profile(gpus)``: the phases of a whole restart on a 16,384-GPU job from published
figures; docs/planning.md ("The restart in phases at 16,384 GPUs") names each source and
says which figures are assumptions.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.planning.two_tier import TierCosts, evaluate, recommend
from steadytrain.report.restarts import PHASES

__all__ = [
    "GOAL",
    "IN_PLACE_MEASURED_S",
    "LLAMA3_IN_PLACE_SHARE",
    "PROFILE",
    "PROFILE_GPUS",
    "breakdown",
    "goal",
    "load_phases",
    "phase_section",
    "scaled_profile",
]

GOAL = 0.98  # the project's goodput goal
# Kill to the next productive step of a SIGKILLed rank recovered in place, 2 ranks on CPU
# (bench/results/inplace_recovery.json, median of 5): detection and regroup included.
IN_PLACE_MEASURED_S = 0.65
# Llama 3 (sec. 3.3.4, table 5): of 466 interruptions, 54 software bugs, 7 NCCL watchdog
# timeouts and 2 dependency failures -- faults of a process on a live node, the ones a
# recovery in place can take; the rest (GPU, HBM, network, host, planned) need a whole
# restart.
LLAMA3_IN_PLACE_SHARE = (54 + 7 + 2) / 466
PROFILE_GPUS = 16384
_HANG_SHARE = 0.099  # ByteRobust: hangs are 9.9 % of incidents
_NCCL_TIMEOUT_S = 600.0  # PyTorch's default NCCL collective timeout
_MONITOR_S = 5.0  # assumed: a crash seen by torchrun's agent and every node within 5 s
_NODE_SHARE = 0.78  # Llama 3: ~78 % of unexpected interruptions were hardware
_RESCHEDULE_S = 300.0  # DLRover: 5 minutes to reschedule a lost node
_RENDEZVOUS_S = 10.0  # pytorch#124982: torchrun rendezvous of 4,000 hosts after the O(n) fix
_NCCL_INIT_S = 150.0  # NCCL#1156: 2.5 min communicator init at large scale
# (phase, seconds at PROFILE_GPUS, the figure it rests on; "assumed" where none is published)
PROFILE: tuple[tuple[str, float, str], ...] = (
    (
        "detection_s",
        _HANG_SHARE * _NCCL_TIMEOUT_S + (1 - _HANG_SHARE) * _MONITOR_S,
        "9.9 % hangs (ByteRobust) caught by the 600 s NCCL timeout, the rest crashes seen "
        "in 5 s (assumed)",
    ),
    ("teardown_s", 30.0, "torchrun's 30 s SIGTERM-to-SIGKILL wait (pytorch#119856)"),
    (
        "relaunch_s",
        _NODE_SHARE * _RESCHEDULE_S,
        "78 % hardware faults (Llama 3) x 5 min to reschedule a node (DLRover)",
    ),
    ("imports_s", 31.0, "import torch from a shared HPC file system, ~31 s"),
    (
        "group_s",
        _RENDEZVOUS_S + _NCCL_INIT_S,
        "rendezvous 10 s at 4,000 hosts (pytorch#124982) + NCCL init 2.5 min (NCCL#1156)",
    ),
    ("build_s", 60.0, "assumed: model, optimizer and loader built on every rank"),
    ("setup_s", 5.0, "assumed"),
    ("restore_s", 480.0, "DLRover: 8 of ~23 min per failure loading the checkpoint"),
    ("first_step_excess_s", 30.0, "assumed: compile with warm caches"),
)
_SCALES = ("group_s",)  # grows with the job (assumed linear in GPUs); the rest held fixed


def _names() -> str:
    return ", ".join(k[:-2] for k in PHASES)


def _phase_key(name: str, where: str) -> str:
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    key = key if key.endswith("_s") else key + "_s"
    if key not in PHASES:
        raise ConfigError(f"{where}: unknown restart phase {name!r}; the phases are {_names()}")
    return key


def _seconds(value: Any, name: str, where: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not (0.0 <= v < math.inf):
        raise ConfigError(
            f"{where}: phase {name!r} = {value!r} must be seconds >= 0, e.g. {name}=30"
        )
    return v


def _checked(pairs: list[tuple[str, Any]], where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in pairs:
        key = _phase_key(str(name), where)
        if key in out:
            raise ConfigError(f"{where}: phase {name!r} given twice")
        out[key] = _seconds(value, str(name), where)
    if not out:
        raise ConfigError(f"{where}: no phases; give e.g. detection=5,imports=30,restore=120")
    return {k: out[k] for k in PHASES if k in out}  # the order they happen


def load_phases(spec: str) -> dict[str, float]:
    """Restart phases from ``--restart-phases``: ``name=seconds,...`` or a .json/.toml file
    holding a table of them (at the top level or under ``phases``). Names as the report
    prints them (``detection``, ``imports``, ... or with ``_s``); seconds >= 0."""
    if "=" in spec:
        pairs = []
        for item in spec.split(","):
            if item.strip():
                name, sep, value = item.partition("=")
                if not sep:
                    raise ConfigError(f"--restart-phases: {item!r} is not name=seconds")
                pairs.append((name, value))
        return _checked(pairs, "--restart-phases")
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--restart-phases {spec}: no such file; give name=seconds pairs "
            f"(detection=5,imports=30,...) or a .json/.toml file of them"
        )
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"{path}: cannot read restart phases ({e}); write a JSON object or a TOML table "
            'of phase = seconds, e.g. {"detection": 5, "restore": 120}'
        ) from None
    if isinstance(data, dict) and isinstance(data.get("phases"), dict):
        data = data["phases"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: restart phases must be a table of phase = seconds")
    return _checked(list(data.items()), str(path))


def scaled_profile(gpus: int) -> tuple[dict[str, float], dict[str, str]]:
    """The whole restart's phases on a job of ``gpus`` GPUs and what each rests on: the
    figures of ``PROFILE`` at 16,384 GPUs, the group phase (rendezvous and communicator
    init, whose work grows with the ranks) scaled linearly with ``gpus`` -- an assumption;
    the rest held as they are."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--scale-to-gpus {gpus!r} must be a whole number of GPUs >= 1")
    phases, basis = {}, {}
    for name, seconds, why in PROFILE:
        scaled = name in _SCALES and gpus != PROFILE_GPUS
        phases[name] = seconds * gpus / PROFILE_GPUS if scaled else seconds
        basis[name] = why + (f"; scaled x {gpus}/{PROFILE_GPUS} (assumed linear)" if scaled else "")
    return phases, basis


def costs_with(c: TierCosts, phases: dict[str, float], scale: float = 1.0) -> TierCosts:
    """``c`` with the whole restart given by ``phases`` (each times ``scale``)."""
    total = scale * sum(phases.values())
    return replace(c, restart_s=total, durable_restore_s=scale * phases.get("restore_s", 0.0))


def breakdown(
    k: int | None, tau: float, c: TierCosts, phases: dict[str, float], mtbf_s: float
) -> dict[str, float]:
    """Each cause's share of the wall time lost at intervals ``(k, tau)`` (module
    docstring); ``c.restart_s`` must be ``sum(phases)`` and ``c.durable_restore_s`` its
    restore phase (``costs_with``). Keys: ``data_stall``, ``snapshot_blocking``,
    ``durable_blocking``, ``lost_work``, ``in_place`` and each phase. They add up to
    ``1 - goodput`` unless the failures alone cost more than all the time (goodput 0)."""
    if abs(sum(phases.values()) - c.restart_s) > 1e-9 * max(1.0, c.restart_s):
        raise ConfigError("breakdown: costs.restart_s is not the sum of the phases")
    e = evaluate(k, tau, c, mtbf_s)
    keep = 1.0 - c.stall_frac
    train = 1.0 - e["blocking_share"]
    per = e["failures_per_s"] * keep * train  # a second of one failure, as a share of time
    f = c.survives if k is not None else 0.0
    q = c.in_place_share if k is not None and e["from_memory"] else 0.0
    out = {
        "data_stall": c.stall_frac,
        "snapshot_blocking": keep * e["snapshot_blocking_share"],
        "durable_blocking": keep * (e["blocking_share"] - e["snapshot_blocking_share"]),
        "lost_work": per * e["lost_per_failure_s"],
        "in_place": per * q * c.in_place_s,
    }
    for name, seconds in phases.items():
        if name != "restore_s":
            out[name] = per * (1.0 - q) * seconds
    r_d = min(c.durable_restore_s, c.restart_s)
    memory = f if e["from_memory"] else 0.0
    out["restore_s"] = per * ((memory - q) * c.memory_restore_s + (1.0 - memory) * r_d)
    return out


def _goodput(c: TierCosts, mtbf_s: float) -> float:
    return recommend(c, mtbf_s)["goodput"]


def _bisect(ok: Any, lo: float, hi: float, steps: int = 40) -> float:
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)`` for ``ok`` true at ``lo`` and
    false past a single point."""
    for _ in range(steps):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def goal(c: TierCosts, phases: dict[str, float], mtbf_s: float, target: float = GOAL) -> dict:
    """What ``target`` goodput (both tiers, intervals chosen again) would take: ``scale``,
    the factor every whole-restart phase must be multiplied by (None: not even free
    restarts reach it; 1.0: reached already); ``phases_s`` at that factor;
    ``free_restarts_goodput``, the ceiling of what shorter phases can give, and
    ``free_restarts_loss``, what is lost there (lost work, blocking, stall); and
    ``in_place_share``, the share of failures that would have to be recovered in place at
    today's phases (None: not even every failure memory survives)."""
    base = costs_with(c, phases)
    now = _goodput(base, mtbf_s)
    zero = costs_with(c, phases, 0.0)
    rec = recommend(zero, mtbf_s)
    free = rec["goodput"]
    tau = math.inf if rec["durable_interval_min"] is None else rec["durable_interval_min"] * 60
    rest = breakdown(rec["memory_every_steps"], tau, zero, {k: 0.0 for k in phases}, mtbf_s)
    if now >= target:
        scale: float | None = 1.0
    elif free < target:
        scale = None
    else:
        scale = _bisect(lambda x: _goodput(costs_with(c, phases, 1.0 - x), mtbf_s) < target, 0, 1)
        scale = 1.0 - scale
    q_hi = base.survives
    share: float | None
    if now >= target:
        share = base.in_place_share
    elif _goodput(replace(base, in_place_share=q_hi), mtbf_s) < target:
        share = None
    else:
        lo = base.in_place_share
        share = lo + _bisect(
            lambda d: _goodput(replace(base, in_place_share=lo + d), mtbf_s) < target, 0, q_hi - lo
        )
    return {
        "target": target,
        "goodput": now,
        "reached": now >= target,
        "scale": scale,
        "restart_s": None if scale is None else scale * base.restart_s,
        "phases_s": None if scale is None else {k: scale * v for k, v in phases.items()},
        "free_restarts_goodput": free,
        # What is left with free restarts (the intervals chosen for them): what else to cut.
        "free_restarts_loss": {k: v for k, v in rest.items() if k not in phases and v > 0},
        "in_place_share": share,
    }


def phase_section(
    tier: dict[str, Any],
    phases: dict[str, float],
    mtbf_s: float,
    *,
    source: str,
    basis: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The ``two_tier.phases`` key of ``plan --json``: the phases, where each point of the
    loss goes (both tiers at their recommended intervals, and durable-only), and the goal.
    ``tier``: what ``two_tier_section`` returned for costs built from these phases."""
    c = TierCosts(**{k: v for k, v in tier["costs"].items() if k in TierCosts.__dataclass_fields__})
    k = tier["memory_every_steps"]
    tau = math.inf if tier["durable_interval_min"] is None else tier["durable_interval_min"] * 60
    d = tier["durable_only"]["durable_interval_min"]
    d_tau = math.inf if d is None else d * 60.0
    return {
        "source": source,
        "phases_s": phases,
        "basis": basis,
        "restart_s": sum(phases.values()),
        "in_place_share": c.in_place_share,
        "in_place_s": c.in_place_s,
        "loss": breakdown(k, tau, c, phases, mtbf_s),
        "loss_durable_only": breakdown(None, d_tau, c, phases, mtbf_s),
        "goal": goal(c, phases, mtbf_s),
    }
