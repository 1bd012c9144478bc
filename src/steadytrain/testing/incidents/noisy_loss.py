"""Incident replay ``noisy-loss``: sequential reading of documents stored in topic order.

A dataset built by concatenating sources (one crawl after another, one language after
another, code after prose) stores correlated documents next to each other. Read with
``data.shuffle=sequential`` (meant for data shuffled offline by ``steadytrain shuffle``),
each batch holds one topic, the model adapts to it, and the next topic's batches make the
loss jump: the curve is noisy for a reason that is not the model's. ``data.shuffle=global``
(a full keyed permutation, the default) mixes every topic into every batch.

The dataset is real text in three kinds with very different byte statistics (the stdlib's
documentation prose, its Python source, its code-page decoding tables), stored in blocks of
``BLOCK_TOKENS`` (a few steps each) cycling prose, code, tables, prose, ... The same tiny job
runs twice on one node each of a 2-node harness, at the same time (only the order differs):

- **without the fix**: ``data.shuffle=sequential``;
- **with the fix**: ``data.shuffle=global``.

What it measures: each run's loss per step, and the variance of the step-to-step change
``loss[t+1] - loss[t]`` after ``BURN_IN`` steps (while both curves fall steeply from
ln(257), that fall, not the order, dominates). ``loss_variance.ratio`` (sequential over
global) is the replay's number; ``loss.png``/``loss.html`` in the workdir show both curves.

The replay writes no diagnosis: the sequential run's report must find one ``data-order``
incident from the run's own loss and configured order (steadytrain.diagnose), the global
run's none (``expected``, ``checks``).
"""

from __future__ import annotations

import glob
import html
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    incident_rows,
    read_trace,
    reports,
    run_summary,
)
from steadytrain.testing.incidents.expect import expectation, judge, node_ranks
from steadytrain.testing.nodes import NodeHarness

__all__ = [
    "BLOCK_TOKENS",
    "BURN_IN",
    "STEPS",
    "expected",
    "loss_curve",
    "ordered_documents",
    "replay",
    "step_variance",
]

# 32 samples x 64 tokens = 2,048 tokens a step: a block of 8,192 tokens is 4 steps of one
# topic. A global batch of 8 (TINY_SETTINGS) would mix too few samples: its own loss would
# swing with how many of each topic a batch drew, hiding the difference the replay shows.
# 16-sample micro-batches keep a step's cost that of the tiny settings (overhead-bound).
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 32, 16, 64
STEPS, BLOCK_TOKENS, BURN_IN = 40, 4 * GLOBAL_BATCH * SEQ_LEN, 8
_TOPICS = ("prose", "code", "tables")


def _topic_files() -> dict[str, list[str]]:
    """Real text of three kinds, in a fixed order (the Python that runs the replay)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return {
        "prose": [
            os.path.join(stdlib, "pydoc_data", "topics.py"),
            os.path.join(stdlib, "LICENSE.txt"),
        ],
        "code": sorted(glob.glob(os.path.join(stdlib, "json", "*.py")))
        + sorted(glob.glob(os.path.join(stdlib, "email", "*.py"))),
        "tables": sorted(glob.glob(os.path.join(stdlib, "encodings", "cp*.py"))),
    }


def ordered_documents(
    dest: str, *, tokens: int, block_tokens: int = BLOCK_TOKENS, doc_bytes: int = 512
) -> str:
    """A dataset of about ``tokens`` tokens (bytes tokenizer) whose documents (~``doc_bytes``
    each) come in topic blocks of ``block_tokens``: prose, code, tables, prose, ...
    Returns ``dest``."""
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter

    streams = {}
    for topic, files in _topic_files().items():
        data = b"".join(open(p, "rb").read() for p in files)  # noqa: SIM115 - read-only
        need = tokens // len(_TOPICS) + block_tokens  # this topic's share, and a spare block
        if len(data) < need:
            raise RuntimeError(f"{topic}: {len(data)} bytes of {files}, need {need}")
        streams[topic] = np.frombuffer(data[:need], dtype=np.uint8).astype(np.uint16)
    tok = {"type": "bytes", "vocab_size": 257, "eos_id": 256}
    offsets = dict.fromkeys(_TOPICS, 0)
    total, block = 0, 0
    with DatasetWriter(
        dest, vocab_size=257, eos_id=256, tokenizer=tok, shard_tokens=8 * block_tokens
    ) as w:
        while total < tokens:
            topic = _TOPICS[block % len(_TOPICS)]
            end = offsets[topic] + block_tokens
            chunk = streams[topic][offsets[topic] : end]
            offsets[topic] = end
            for doc in np.array_split(chunk, max(1, chunk.size // doc_bytes)):
                w.add_document(np.append(doc, 256))
                total += doc.size + 1
            block += 1
    return dest


def loss_curve(run_dir: str) -> list[tuple[int, float]]:
    """``(step, loss)`` of a run, the newest record of each step."""
    by_step = {int(r["step"]): float(r["loss"]) for r in read_trace(run_dir) if "loss" in r}
    return sorted(by_step.items())


def step_variance(losses: list[float]) -> float:
    """Variance of ``loss[t+1] - loss[t]``."""
    d = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    if len(d) < 2:
        raise ValueError(f"need at least 3 losses for a step-to-step variance, got {len(losses)}")
    mean = sum(d) / len(d)
    return sum((x - mean) ** 2 for x in d) / (len(d) - 1)


def expected(run_dir: str, steps: int) -> dict[str, Any]:
    """One ``data-order`` incident over most of the run: the order is the job's, not a
    node's, so the report may name the run's nodes or none (ranks are not checked)."""
    nodes = list(node_ranks(run_dir))
    return expectation(
        "data-order",
        [],
        node_ranks(run_dir),
        (1, steps // 2),
        (steps // 2, steps),
        allow_nodes=nodes,
        check_ranks=False,
    )


def _timeline(run_dir: str, rep: dict[str, Any], path: str, plt: Any) -> None:
    """The sequential run's per-node timeline with its report's incidents."""
    from steadytrain.monitor.ranks import read_ranks
    from steadytrain.report.timeline import draw_timeline, node_attempts, timeline

    draw_timeline(timeline(rep, node_attempts(read_ranks(run_dir))), Path(path), plt)


def _plot(
    curves: dict[str, list[tuple[int, float]]],
    ratio: float,
    workdir: str,
    seq_run: tuple[str, dict[str, Any]],
) -> str:
    """``loss.png`` (both curves), ``timeline.png`` (the sequential run's nodes and its
    report's incidents) and ``loss.html`` (the pictures and the numbers)."""
    from steadytrain.extras import require

    matplotlib = require("matplotlib", "the noisy-loss replay's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _timeline(*seq_run, os.path.join(workdir, "timeline.png"), plt)

    fig, ax = plt.subplots(figsize=(10, 4))
    colors = {"sequential": "#c62828", "global": "#1565c0"}
    for name, curve in curves.items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], lw=1.4, color=colors[name],
                label=f"data.shuffle={name}")  # fmt: skip
    ax.axvline(BURN_IN + 0.5, color="#9e9e9e", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"Topic-ordered documents: step-to-step loss variance, sequential / global = {ratio:.1f}"
        f" (after step {BURN_IN})"
    )
    ax.legend()
    png = os.path.join(workdir, "loss.png")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    page = os.path.join(workdir, "loss.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(
            "<!doctype html><html><head><meta charset='utf-8'><title>noisy-loss replay</title>"
            "</head><body style='font-family:sans-serif;max-width:1000px;margin:2em auto'>"
            "<h1>Noisy loss: sequential reading of topic-ordered documents</h1>"
            f"<img src='loss.png' alt='loss curves' style='max-width:100%'>"
            f"<p>Variance of loss[t+1] - loss[t] after step {BURN_IN}: sequential / global = "
            f"<b>{ratio:.2f}</b>. Blocks of {BLOCK_TOKENS} tokens cycle through "
            f"{html.escape(', '.join(_TOPICS))}.</p>"
            "<h2>Per node (data.shuffle=sequential)</h2>"
            "<img src='timeline.png' alt='timeline' style='max-width:100%'></body></html>\n"
        )
    return page


def replay(workdir: str, *, log: Log) -> dict[str, Any]:
    """Both runs at once on a 2-node harness under ``workdir``; see the module docstring."""
    t0 = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    tokens = int(STEPS * GLOBAL_BATCH * SEQ_LEN * 1.05)  # what a run reads, and a little
    ds = ordered_documents(os.path.join(workdir, "dataset"), tokens=tokens)
    settings = [
        f"data.dataset={ds}",
        f"data.seq_len={SEQ_LEN}",
        f"data.global_batch={GLOBAL_BATCH}",
        f"data.micro_batch={MICRO_BATCH}",
        f"train.max_steps={STEPS}",
        "checkpoint.every_steps=1000",  # no saves: the run is about the order
        "optim.lr=3e-3",  # a fast learner adapts to each topic: the effect shows in 40 steps
    ]
    runs = {"without_fix": "sequential", "with_fix": "global"}
    dirs = {run: os.path.join(workdir, run) for run in runs}
    h = NodeHarness(os.path.join(workdir, "harness"), nodes=2, cache_size="16M", log=log)
    with h:
        log(f"[noisy-loss] {STEPS} steps each, data.shuffle=sequential on node-0 and "
            "data.shuffle=global on node-1, at the same time")  # fmt: skip
        jobs = [
            IncidentJob(h, [node], dirs[run], [*settings, f"data.shuffle={mode}"])
            for node, (run, mode) in zip(h.nodes, runs.items(), strict=True)
        ]
        for job in jobs:
            job.wait(timeout=300)
    leftovers = h.leftovers()
    log("[noisy-loss] both runs done, building the reports")
    reps = reports(dirs)
    curves = {mode: loss_curve(dirs[run]) for run, mode in runs.items()}
    for mode, curve in curves.items():
        if len(curve) < STEPS:
            raise RuntimeError(f"the {mode} run traced {len(curve)} of {STEPS} steps")
    var = {mode: step_variance([v for s, v in c if s > BURN_IN]) for mode, c in curves.items()}
    ratio = var["sequential"] / var["global"] if var["global"] > 0 else float("inf")
    seq = curves["sequential"]
    jumps = [(abs(b[1] - a[1]), b[0], b[1] - a[1]) for a, b in zip(seq, seq[1:], strict=False)
             if a[0] > BURN_IN]  # fmt: skip
    size, at, _ = max(jumps)
    page = _plot(curves, ratio, workdir, (dirs["without_fix"], reps["without_fix"]))
    incidents = [*incident_rows(reps["without_fix"], "without_fix"),
                 *incident_rows(reps["with_fix"], "with_fix")]  # fmt: skip
    want = {"without_fix": [expected(dirs["without_fix"], STEPS)], "with_fix": []}
    return {
        "incident": "noisy-loss",
        "mode": h.mode,
        "mode_reason": h.reason,
        "incidents": incidents,
        "expected": want,
        "checks": judge(want, incidents),
        "goodput": {run: reps[run].get("goodput") for run in runs},
        "runs": {run: {**run_summary(dirs[run], reps[run]), "shuffle": runs[run]} for run in runs},
        "seconds": time.monotonic() - t0,
        "steps": STEPS,
        "burn_in": BURN_IN,
        "block_tokens": BLOCK_TOKENS,
        "loss": {mode: [v for _, v in c] for mode, c in curves.items()},
        "loss_variance": {**var, "ratio": ratio},
        "largest_jump": {"step": at, "size": size},
        "comparison_html": page,
        "leftovers": leftovers,
    }
