"""``steadytrain plan``'s restart in phases (issue 44): the flags that give the phases, and
their table (planning/restart_plan.py computes; docs/planning.md, "The restart in phases")."""

from __future__ import annotations

import argparse
from typing import Any

from steadytrain.commands.plan import _pct

__all__ = ["phases_from_flags", "print_phases"]


def phases_from_flags(args: argparse.Namespace) -> tuple[dict[str, float], str, dict | None] | None:
    """The restart's phases the flags give (None: none), where they come from, and what
    each figure rests on; a phase flag with ``--restart-cost``/``--durable-restore`` is an
    error (the phases are the restart)."""
    from steadytrain.errors import ConfigError
    from steadytrain.planning import restart_plan

    if args.restart_phases is None and args.scale_to_gpus is None:
        if args.in_place_share is not None or args.in_place_cost is not None:
            raise ConfigError(
                "--in-place-share/--in-place-cost need the restart in phases: add "
                "--restart-phases or --scale-to-gpus"
            )
        return None
    if args.restart_phases is not None and args.scale_to_gpus is not None:
        raise ConfigError("give --restart-phases or --scale-to-gpus, not both")
    for flag, value in (("--restart-cost", args.restart_cost),
                        ("--durable-restore", args.durable_restore)):  # fmt: skip
        if value is not None:
            raise ConfigError(
                f"{flag} with the restart in phases: the phases are the restart (their sum is "
                "R, their restore phase the restore from storage); drop one"
            )
    if args.restart_phases is not None:
        return restart_plan.load_phases(args.restart_phases), "given", None
    phases, basis = restart_plan.scaled_profile(args.scale_to_gpus)
    return phases, f"published figures scaled to {args.scale_to_gpus} GPUs", basis


def print_phases(con: Any, ph: dict[str, Any], tt: dict[str, Any]) -> None:
    """Each phase's seconds and its share of the loss, then what the goal would take."""
    loss, only = ph["loss"], ph["loss_durable_only"]
    lost = 1.0 - tt["goodput"]
    out = [
        f"the restart in phases ({ph['source']}): R = {ph['restart_s']:.4g} s; "
        f"{_pct(ph['in_place_share'])} of failures recovered in place at "
        f"{ph['in_place_s']:.3g} s",
        f"  {'phase':<19} {'seconds':>8}  {'two tiers: points':>17} {'of the loss':>11}  "
        f"{'durable only':>12}",
    ]
    names = [*ph["phases_s"], "in_place", "lost_work", "snapshot_blocking",
             "durable_blocking", "data_stall"]  # fmt: skip
    for name in names:
        secs = ph["phases_s"].get(name)
        label = name[:-2] if name.endswith("_s") else name
        share = loss[name] / lost if lost > 0 else 0.0
        out.append(
            f"  {label.replace('_', ' '):<19} {'' if secs is None else f'{secs:.4g}':>8}  "
            f"{100 * loss[name]:>17.2f} {_pct(share):>11}  {100 * only[name]:>12.2f}"
        )
        if ph.get("basis") and name in ph["basis"]:
            out.append(f"  {'':<19}   ({ph['basis'][name]})")
    g = ph["goal"]
    target = _pct(g["target"])
    if g["reached"]:
        out.append(f"goal {target}: reached ({_pct(g['goodput'])} with both tiers)")
    elif g["scale"] is None:
        out.append(
            f"goal {target}: out of reach from the restart alone: with free restarts both "
            f"tiers give {_pct(g['free_restarts_goodput'])}, losing "
            + ", ".join(
                f"{k.replace('_', ' ')} {100 * v:.2f}"
                for k, v in sorted(g["free_restarts_loss"].items(), key=lambda kv: -kv[1])
            )
            + " points"
        )
    else:
        each = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3g}" for k, v in g["phases_s"].items())
        out.append(
            f"goal {target}: every whole-restart phase x {g['scale']:.2f} (R {ph['restart_s']:.4g}"
            f" -> {g['restart_s']:.4g} s): {each} s"
        )
    if not g["reached"]:
        out.append(
            f"  or, at today's phases, recover {_pct(g['in_place_share'])} of failures in place"
            if g["in_place_share"] is not None
            else "  recovering in place every failure memory survives is not enough either"
        )
    for line in out:
        con.print(line, markup=False, highlight=False, soft_wrap=True)
