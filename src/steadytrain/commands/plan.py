"""``steadytrain plan``: failure model -> checkpoint interval that maximises goodput."""

from __future__ import annotations

import argparse
from typing import Any

# For the help text only: the planner (steadytrain.planning.from_run) owns the defaults and
# is imported lazily, so that `steadytrain --help` stays fast; a test keeps the two equal.
DEFAULT_CKPT_COST_S = 30.0
DEFAULT_RESTART_COST_S = 300.0


HELP = "choose the checkpoint interval from cluster size, failure rate and costs"
DESCRIPTION = (
    "Probability of failure, best checkpoint interval (Young, Daly, exact) and the "
    "goodput of sync and async saves, checked by a Monte-Carlo simulation. Give the "
    "failure rate one way: --gpus/--afr, --mtbf-hours or --interruptions-per-day "
    "(default: the Llama 3 rate per GPU). --two-tier adds the memory tier's snapshot "
    "interval and compares two tiers with durable-only. See docs/planning.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("failure rate (one of --afr, --mtbf-hours, --interruptions-per-day)")
    g.add_argument(
        "--gpus", type=int, metavar="N", help="GPUs in the job (scales --afr; default 1024)"
    )
    g.add_argument(
        "--days", type=float, default=30.0, metavar="D", help="run length in days (default 30)"
    )
    g.add_argument(
        "--afr", type=float, metavar="RATE", help="failures per GPU per year, e.g. 0.01 for 1%%"
    )
    g.add_argument(
        "--mtbf-hours", type=float, metavar="H", help="mean time between failures of the job"
    )
    g.add_argument(
        "--interruptions-per-day", type=float, metavar="X", help="observed job interruptions a day"
    )
    c = p.add_argument_group("costs (seconds; --from-run measures them)")
    c.add_argument(
        "--ckpt-cost",
        type=float,
        metavar="S",
        help=f"seconds a save blocks training (default {DEFAULT_CKPT_COST_S:g})",
    )
    c.add_argument(
        "--durable-time",
        type=float,
        metavar="S",
        help="seconds from the start of a save until it is durable (async; default = --ckpt-cost)",
    )
    c.add_argument(
        "--async-ckpt-cost",
        type=float,
        metavar="S",
        help="blocking seconds of an async save, for the sync/async comparison",
    )
    c.add_argument(
        "--restart-cost",
        type=float,
        metavar="S",
        help=f"seconds one restart costs (default {DEFAULT_RESTART_COST_S:g})",
    )
    c.add_argument(
        "--data-stall", type=float, metavar="FRAC", help="share of step time waiting for data (0-1)"
    )
    c.add_argument("--from-run", metavar="RUN_DIR", help="measure costs from RUN_DIR/ledger.jsonl")
    p.add_argument("--interval", type=float, metavar="MIN", help="evaluate this interval (minutes)")
    s = p.add_argument_group("simulation")
    s.add_argument(
        "--sim-runs", type=int, default=2000, metavar="N", help="simulated runs (0: skip)"
    )
    s.add_argument("--seed", type=int, default=0, help="simulation seed (default 0)")
    s.add_argument(
        "--failure-shape",
        type=float,
        default=1.0,
        metavar="K",
        help="Weibull shape of failure gaps (1: Poisson)",
    )
    m = p.add_argument_group(
        "memory tier (--two-tier: snapshots in node memory + a peer, and durable saves)"
    )
    m.add_argument(
        "--two-tier",
        action="store_true",
        help="recommend both intervals, against durable-only, here and at reference rates",
    )
    m.add_argument("--step-time", type=float, metavar="S", help="seconds of one step (default 6)")
    m.add_argument(
        "--memory-cost", type=float, metavar="S", help="seconds a snapshot blocks (default 0.5)"
    )
    m.add_argument(
        "--memory-restore", type=float, metavar="S", help="seconds to restore from memory"
    )
    m.add_argument(
        "--durable-restore",
        type=float,
        metavar="S",
        help="seconds of --restart-cost spent restoring from storage (default half of it)",
    )
    m.add_argument(
        "--memory-survives",
        type=float,
        metavar="FRAC",
        help="share of failures memory survives: crashes, one node lost (default 0.75)",
    )
    r = p.add_argument_group(
        "restart in phases (imply --two-tier; docs/planning.md, 'The restart in phases')"
    )
    r.add_argument(
        "--restart-phases",
        metavar="SPEC",
        help="the whole restart as phases: detection=S,teardown=S,relaunch=S,imports=S,"
        "group=S,build=S,setup=S,restore=S,first_step_excess=S, or a .json/.toml file of them",
    )
    r.add_argument(
        "--scale-to-gpus",
        type=int,
        metavar="N",
        help="the phases of a whole restart on N GPUs from published figures (16384: Llama 3's "
        "cluster)",
    )
    r.add_argument(
        "--in-place-share",
        type=float,
        metavar="FRAC",
        help="share of failures recovered in place: process faults on a live node (default "
        "63/466, Llama 3's software faults)",
    )
    r.add_argument(
        "--in-place-cost",
        type=float,
        metavar="S",
        help="seconds one recovery in place costs (default 0.65 measured here; with "
        "--scale-to-gpus plus that job's detection and group phases)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._plan_phases import phases_from_flags
    from steadytrain.commands._util import print_json
    from steadytrain.planning import restart_plan
    from steadytrain.planning.from_run import plan_from_run

    phased = phases_from_flags(args)
    gpus = args.gpus
    rate_given = any(v is not None for v in (args.afr, args.mtbf_hours, args.interruptions_per_day))
    if phased and args.scale_to_gpus and gpus is None and not rate_given:
        gpus = args.scale_to_gpus  # the default per-GPU rate, on the job the phases are for
    result = plan_from_run(
        args.from_run,
        gpus=gpus,
        afr=args.afr,
        mtbf_hours=args.mtbf_hours,
        interruptions_per_day=args.interruptions_per_day,
        days=args.days,
        ckpt_cost_s=args.ckpt_cost,
        durable_s=args.durable_time,
        async_ckpt_cost_s=args.async_ckpt_cost,
        restart_cost_s=sum(phased[0].values()) if phased else args.restart_cost,
        data_stall_frac=args.data_stall,
        interval_min=args.interval,
        simulate_runs=args.sim_runs,
        seed=args.seed,
        failure_shape=args.failure_shape,
    )
    tier_flags = (
        args.step_time,
        args.memory_cost,
        args.memory_restore,
        args.durable_restore,
        args.memory_survives,
    )
    if args.two_tier or phased or any(v is not None for v in tier_flags):
        from steadytrain.planning.two_tier_plan import measure_tiers, two_tier_section

        in_place: dict[str, float] = {}
        if phased:
            phases = phased[0]
            cost = args.in_place_cost
            if cost is None:  # a regroup at scale pays that job's detection and group init
                cost = restart_plan.IN_PLACE_MEASURED_S
                if args.scale_to_gpus:
                    cost += phases.get("detection_s", 0.0) + phases.get("group_s", 0.0)
            share = args.in_place_share
            in_place = {
                "in_place_share": restart_plan.LLAMA3_IN_PLACE_SHARE if share is None else share,
                "in_place_s": cost,
            }
        result["two_tier"] = two_tier_section(
            result,
            measured=measure_tiers(args.from_run) if args.from_run else None,
            step_s=args.step_time,
            memory_cost_s=args.memory_cost,
            memory_restore_s=args.memory_restore,
            durable_restore_s=phased[0].get("restore_s", 0.0) if phased else args.durable_restore,
            survives=args.memory_survives,
            **in_place,
        )
        if phased:
            result["two_tier"]["phases"] = restart_plan.phase_section(
                result["two_tier"],
                phased[0],
                result["mtbf_hours"] * 3600.0,
                source=phased[1],
                basis=phased[2],
            )
    if args.json:
        print_json(result)
    else:
        _print_human(result)
    return 0


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return ">99.9%" if 0.999 < x < 1.0 else f"{100 * x:.1f}%"


def _min(x: float | None) -> str:
    """An interval in minutes with the precision it needs: tiny costs give intervals of
    seconds, which one decimal would print as "0.0 min"."""
    if x is None:
        return "-"
    if x >= 10 or x == 0:
        return f"{x:.1f} min"
    if x >= 1:
        return f"{x:.2f} min"
    return f"{x:.2g} min ({60 * x:.2g} s)"


def _exposed(r: dict) -> str:
    """``, failures hit 9.6 s of it`` when only part of the restart is exposed."""
    u = r.get("restart_exposed_s")
    if u is None or u >= r["restart_cost_s"]:
        return ""
    return f", failures hit {u:.3g} s of it"


def _shares(badput: dict[str, float]) -> str:
    """``data_wait 9.1%, restart 2.0%, ...``, largest first; the plan's and the run's
    badput use the same names (docs/planning.md)."""
    items = sorted(badput.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {_pct(share)}" for name, share in items)


def _print_human(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="steadytrain plan", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("failure model", r["failure_model"])
    t.add_row(f"P(>=1 failure in {r['days']:g} days)", _pct(r["p_failure"]))
    t.add_row("interruptions / day", f"{r['interruptions_per_day']:.3g}")
    t.add_row("expected interruptions", f"{r['expected_interruptions']:.3g}")
    t.add_row("MTBF", f"{r['mtbf_hours']:.3g} h")
    s = r["sources"]
    t.add_row(
        f"costs ({r['mode']} save)",
        f"C={r['ckpt_cost_s']:.3g} s ({s['ckpt_cost_s']}), L={r['durable_s']:.3g} s, "
        f"R={r['restart_cost_s']:.3g} s ({s['restart_cost_s']}{_exposed(r)}), "
        f"data stall {_pct(r['data_stall_frac'])}",
    )
    phases = (r.get("measured") or {}).get("restart_phases_s")
    if phases and s["restart_cost_s"] == "measured":  # R is their sum (run_costs.py)
        t.add_row(
            "R in phases (mean)",
            ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3g}" for k, v in phases.items()) + " s",
        )
    t.add_row("Young / Daly / exact", " / ".join(
        _min(r[k]) for k in ("young_interval_min", "daly_interval_min", "exact_interval_min")
    ))  # fmt: skip
    t.add_row("optimal interval", _min(r["optimal_interval_min"]))
    t.add_row(f"goodput at {_min(r['interval_min'])} ({r['interval_source']})",
              f"{_pct(r['goodput'])} first order, {_pct(r['goodput_exact'])} exact")  # fmt: skip
    ci = r.get("failure_rate_ci")
    if ci:
        lo, hi = ci["interruptions_per_day"]
        t.add_row(
            "observed rate, 95% interval",
            f"{lo:.3g} to {hi:.3g} interruptions/day ({ci['interruptions']} seen): goodput "
            f"{_pct(ci['goodput_exact'][0])} to {_pct(ci['goodput_exact'][1])} exact",
        )
    if r.get("first_startup_s"):
        t.add_row(
            f"with the first start-up ({r['first_startup_s']:.3g} s once)",
            f"{_pct(r['goodput_run'])} first order, {_pct(r['goodput_exact_run'])} exact "
            f"over {r['days']:g} days",
        )
    t.add_row("badput at that interval (model)", _shares(r["badput"]))
    m = r.get("measured")
    if m:
        t.add_row(
            "this run (measured)",
            f"goodput {_pct(m['goodput'])}; badput {_shares(m['badput'])}",
        )
    sim = r.get("simulation")
    if sim:
        t.add_row(
            f"simulated ({sim['runs']} runs)",
            f"{_pct(sim['mean'])} [{_pct(sim['ci95'][0])}, {_pct(sim['ci95'][1])}]; "
            f"{sim['days']:g}-day runs p5 {_pct(sim['p5'])}, p50 {_pct(sim['p50'])}, "
            f"p95 {_pct(sim['p95'])}",
        )
        agree = {True: "agrees", False: "outside the 99.9% interval"}
        t.add_row(
            "closed form vs simulation",
            f"exact {agree[sim['exact_agrees']]}, first order {agree[sim['first_order_agrees']]}",
        )
    con.print(t)

    modes = r["modes"]
    tab = Table(title="goodput by interval (first order / exact)", title_justify="left")
    tab.add_column("interval", justify="right")
    for name, info in modes.items():
        label = f"{name} C={info['ckpt_cost_s']:.3g}s L={info['durable_s']:.3g}s"
        tab.add_column(label + (" (assumed)" if info["assumed"] else ""), justify="right")
    by_interval: dict[float, dict[str, dict]] = {}
    for row in r["table"]:
        by_interval.setdefault(row["interval_min"], {})[row["mode"]] = row
    best = {round(i["optimal_interval_min"] or -1, 2): n for n, i in modes.items()}
    for mins, rows in by_interval.items():
        cells = [f"{_pct(rows[n]['goodput'])} / {_pct(rows[n]['goodput_exact'])}" for n in modes]
        if mins in best:  # the table's interval is rounded: show the optimum itself
            opt = modes[best[mins]]["optimal_interval_min"]
            when = f"{60 * opt:.2g} s" if opt < 1 else _min(opt)
            label = f"{when}  <- best {best[mins]}"
        else:
            label = f"{mins:g} min"
        tab.add_row(label, *cells)
    con.print(tab)
    for note in r["notes"]:
        con.print(f"note: {note}")
    if r.get("two_tier"):
        _print_two_tier(con, r["two_tier"], r)


def _steps(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _print_two_tier(con: Any, tt: dict[str, Any], r: dict[str, Any]) -> None:
    from steadytrain.planning.two_tier_plan import SCENARIOS

    c, src = tt["costs"], tt["sources"]
    con.print(
        f"two tiers: step {c['step_s']:.3g} s ({src['step_s']}), snapshot blocks "
        f"{c['memory_cost_s']:.3g} s ({src['memory_cost_s']}), restart from memory "
        f"{c['memory_restart_s']:.3g} s (restore {c['memory_restore_s']:.3g} s, "
        f"{src['memory_restore_s']}) against {c['restart_s']:.3g} s from storage; memory "
        f"survives {_pct(c['survives'])} of failures ({src['survives']})"
    )
    # Plain lines (a table of rich would wrap its cells at 80 columns).
    out = [
        "two tiers against durable-only (first order): memory = a snapshot every K steps, "
        "durable = its interval; gain in points; steps lost per failure",
        f"  {'rate':<13} {'/day':>6}  {'durable only':>20}  {'memory':>7} {'durable':>10}  "
        f"{'two tiers':>9} {'gain':>6}  {'steps lost':>15}",
    ]
    rows = [("this plan", r["interruptions_per_day"], tt)]
    rows += [(s["name"], s["interruptions_per_day"], s) for s in tt["scenarios"]]
    for name, per_day, x in rows:
        d = x["durable_only"]
        k = x["memory_every_steps"]
        tau = x["durable_interval_min"]
        lost = f"{_steps(x['steps_lost_per_failure'])} vs {_steps(d['steps_lost_per_failure'])}"
        out.append(
            f"  {name:<13} {per_day:>6.2g}  "
            f"{_pct(d['goodput']) + ' at ' + _min(d['durable_interval_min']):>20}  "
            f"{'off' if k is None else 'K=' + str(k):>7} {'never' if tau is None else _min(tau):>10}  "
            f"{_pct(x['goodput']):>9} {100 * x['gain']:>+6.2f}  {lost:>15}"
        )
    out += [f"  {name}: {what}" for name, what, _ in SCENARIOS]
    for line in out:
        con.print(line, markup=False, highlight=False, soft_wrap=True)
    for note in tt["notes"]:
        con.print(f"note: {note}", markup=False)
    if tt.get("phases"):
        from steadytrain.commands._plan_phases import print_phases

        print_phases(con, tt["phases"], tt)
