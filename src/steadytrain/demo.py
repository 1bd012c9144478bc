"""``steadytrain demo``: the whole story on embedded defaults (stage 1: data).

Stage 1 tokenizes the embedded corpus (the Python standard library's source) into
``RUN_DIR/data`` and summarises it. Later stages (training with injected crashes, resume,
goodput report) extend ``run_demo``; its JSON keys only grow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run_demo", "default_run_dir"]


def default_run_dir(base: str = "runs") -> str:
    return os.path.join(base, time.strftime("demo-%Y%m%d-%H%M%S"))


def run_demo(
    run_dir: str | None = None,
    *,
    tokenizer: str = "bytes",
    workers: int | None = None,
    corpus_limit_bytes: int | None = None,
    quiet: bool = True,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenize the stdlib corpus into ``run_dir/data``; returns the demo summary."""
    from steadytrain.data.corpus import stdlib_corpus_paths
    from steadytrain.data.progress import make_progress
    from steadytrain.data.tokenize import tokenize
    from steadytrain.data.verify import dataset_info

    run_dir = run_dir or default_run_dir()
    os.makedirs(run_dir, exist_ok=True)
    data_dir = os.path.join(run_dir, "data")
    result = tokenize(
        stdlib_corpus_paths(corpus_limit_bytes),
        data_dir,
        tokenizer=tokenizer,
        workers=workers,
        progress=make_progress(quiet),
        warn=warn,
    )
    info = dataset_info(data_dir)
    info["tokenize_seconds"] = round(result.seconds, 3)
    info["tokens_per_s"] = round(result.tokens_per_s, 1)
    info["replaced_files"] = result.replaced_files
    return {
        "run_dir": run_dir,
        "steps": 0,
        "restarts": 0,
        "goodput": None,
        "report": None,
        "dataset": info,
    }
