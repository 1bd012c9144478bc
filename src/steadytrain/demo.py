"""``steadytrain demo``: the whole story on embedded defaults.

1. **Data**: tokenize the embedded corpus (the Python standard library's source) into
   ``RUN_DIR/data`` and verify it.
2. **Training**: 2 ranks under ``torchrun`` on CPU with asynchronous checkpoints; one crash
   in the middle of a step and one while a checkpoint is being written; torchrun restarts
   the ranks and each restart resumes from the newest committed checkpoint by itself.
3. **Report**: the goodput breakdown from the run's ledger (``steadytrain report``).
4. **Plan**: the checkpoint interval the planner recommends from the costs this run
   measured, at this run's failure rate and at a large cluster's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from steadytrain.data.ingest.corpus import stdlib_dir

__all__ = ["run_demo", "default_run_dir", "demo_plan"]

# A large cluster for the planner's projection: Llama 3's ~8.6 interruptions a day on 16k GPUs.
CLUSTER_INTERRUPTIONS_PER_DAY = 8.6


def default_run_dir(base: str = "runs") -> str:
    return os.path.join(base, time.strftime("demo-%Y%m%d-%H%M%S"))


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# What the demo shows of each plan (the full plans are what `steadytrain plan --from-run
# RUN_DIR --json` prints, with `--days 1` and with `--interruptions-per-day 8.6`).
PLAN_KEYS = (
    "interruptions_per_day",
    "optimal_interval_min",
    "goodput_at_optimal",
    "goodput",
    "ckpt_cost_s",
    "durable_s",
    "restart_cost_s",
    "data_stall_frac",
    "badput",
)
DEMO_SIM_RUNS = 200


def demo_plan(run_dir: str) -> dict[str, Any]:
    """The planner's recommendation from the costs measured in ``run_dir``'s ledger, at this
    run's failure rate and at a large cluster's: ``steadytrain plan --from-run`` itself
    (``planning.plan_from_run``), so the demo and the command never disagree."""
    from steadytrain.planning import measure_run, plan_from_run

    measured = measure_run(run_dir)  # read once, planned twice
    here = plan_from_run(run_dir, measured=measured, days=1.0, simulate_runs=DEMO_SIM_RUNS)
    cluster = plan_from_run(
        run_dir,
        measured=measured,
        interruptions_per_day=CLUSTER_INTERRUPTIONS_PER_DAY,
        simulate_runs=DEMO_SIM_RUNS,
    )
    return {
        "measured": measured.to_dict(),
        "this_run": {k: here[k] for k in PLAN_KEYS},
        "cluster": {k: cluster[k] for k in PLAN_KEYS},
    }


# The end of tokenize's "not valid UTF-8 ... replaced with U+FFFD" messages (data/ingest/sources).
DECODE_REPLACED = "replaced with U+FFFD"


def _replaced_summary(messages: list[str], replacements: int) -> str:
    """One line for the corpus files that are not UTF-8, naming one of them."""
    first = messages[0].split(": ", 1)[0]
    example = os.path.relpath(first, stdlib_dir()) if os.path.isabs(first) else first
    return (
        f"{len(messages)} standard-library file(s) are not UTF-8 on purpose (encoding tests, "
        f"e.g. {example}): {replacements} invalid byte sequence(s) read as U+FFFD; "
        f"`steadytrain tokenize` names each such file of your own corpus"
    )


def run_demo(
    run_dir: str | None = None,
    *,
    tokenizer: str = "bytes",
    workers: int | None = None,
    corpus_limit_bytes: int | None = None,
    steps: int = 300,
    train: bool = True,
    quiet: bool = True,
    out: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every stage; returns the summary (``--json`` prints it)."""
    from steadytrain.data.ingest.corpus import stdlib_corpus_paths
    from steadytrain.data.ingest.progress import make_progress
    from steadytrain.data.ingest.tokenize import tokenize
    from steadytrain.data.ingest.verify import dataset_info, verify_dataset

    say = out or (lambda _line: None)
    run_dir = run_dir or default_run_dir()
    os.makedirs(run_dir, exist_ok=True)
    data_dir = os.path.join(run_dir, "data")
    say(f"[demo] 1/4 tokenizing the Python standard library's source into {data_dir}")
    # The stdlib ships a few test files in other encodings on purpose: for the demo's own
    # corpus they are expected, so they get one summary line, not a warning per file.
    # Anything else tokenize reports still reaches ``warn``.
    replaced: list[str] = []

    def corpus_warn(msg: str) -> None:
        if DECODE_REPLACED in msg:
            replaced.append(msg)
        elif warn is not None:
            warn(msg)

    result = tokenize(
        stdlib_corpus_paths(corpus_limit_bytes),
        data_dir,
        tokenizer=tokenizer,
        workers=workers,
        progress=make_progress(quiet),
        warn=corpus_warn,
    )
    if replaced:
        say(f"[demo]     {_replaced_summary(replaced, result.replacements)}")
    info = dataset_info(data_dir)
    info["tokenize_seconds"] = round(result.seconds, 3)
    info["tokens_per_s"] = round(result.tokens_per_s, 1)
    info["replaced_files"] = result.replaced_files
    info["verified"] = verify_dataset(data_dir).ok
    say(
        f"[demo]     {info['num_tokens']:,} tokens, {info['num_docs']:,} documents, "
        f"{info['num_shards']} shard(s), {info['dtype']}, vocab {info['vocab_size']}; "
        f"{result.tokens_per_s / 1e6:.1f} M tokens/s; verify: "
        f"{'ok' if info['verified'] else 'FAILED'}"
    )
    summary: dict[str, Any] = {
        "run_dir": run_dir,
        "steps": 0,
        "restarts": 0,
        "goodput": None,
        "report": None,
        "dataset": info,
    }
    if not train:
        return summary

    from steadytrain.report.recoveries import recovery_lines
    from steadytrain.train.demo_run import run_demo_training

    say("[demo] 2/4 training under torchrun with injected crashes")
    # In place: the mid-step crash's survivor keeps its process (issue 44); the whole
    # restart remains the fallback, and the report says which path each recovery took.
    t = run_demo_training(run_dir, data_dir, steps=steps, out=say, inplace=True)
    summary.update(
        steps=t["steps"],
        restarts=t["restarts"],
        goodput=t["goodput"],
        report=t["report"],
        report_json=t.get("report_json"),
        crashes=t.get("crashes"),
        restored_steps=t.get("restored_steps"),
        breakdown=t.get("breakdown"),
        job_state=t.get("job_state"),
        training_wall_s=t.get("wall_s"),
        mlflow=t.get("mlflow"),
        recoveries=t.get("recoveries"),
    )
    # The report's numbers (steadytrain report of this run), not a second computation.
    say("[demo] 3/4 goodput: where the wall time went (the run's report)")
    b = t.get("breakdown") or {}
    if t.get("job_state"):
        say(f"[demo]     {t['job_state']['text']}")
    say(f"[demo]     {'goodput':<18} {100 * (t['goodput'] or 0):5.1f} %  (productive steps kept)")
    for name, share in sorted((b.get("badput") or {}).items(), key=lambda kv: -kv[1]):
        say(f"[demo]     {name:<18} {100 * share:5.1f} %  ({b['badput_s'][name]:.1f} s)")
    for line in recovery_lines(t):  # which path each recovery took, why, its phases
        say(f"[demo]     {line}")
    say(f"[demo]     report: {t['report']}")
    if t.get("mlflow"):  # None: the MLflow extra is missing (training said so, once)
        m = t["mlflow"]
        say(f"[demo]     MLflow: {m['tracking_uri']}")
        say(f"[demo]     open it: pip install {m['ui_package']} && {m['ui']}")

    say("[demo] 4/4 the planner's checkpoint interval from the costs this run measured")
    plan = demo_plan(run_dir)
    summary["plan"] = plan
    m = plan["measured"]
    say(
        f"[demo]     measured: checkpoint blocks {1000 * (m['ckpt_cost_s'] or 0):.0f} ms, "
        f"durable after {m['durable_s'] or 0:.2f} s, restart costs {m['restart_cost_s'] or 0:.1f} s, "
        f"data stall {100 * m['data_stall_frac']:.1f} % of step time"
    )
    here, cluster = plan["this_run"], plan["cluster"]
    say(
        f"[demo]     at this run's rate ({here['interruptions_per_day']:.0f} interruptions/day): "
        f"checkpoint every {_duration(60 * here['optimal_interval_min'])} "
        f"(goodput {100 * here['goodput_at_optimal']:.1f} %)"
    )
    say(
        f"[demo]     on a large cluster ({cluster['interruptions_per_day']} interruptions/day): "
        f"every {_duration(60 * cluster['optimal_interval_min'])} "
        f"(goodput {100 * cluster['goodput_at_optimal']:.1f} %)"
    )
    return summary
