"""What every incident replay shares: tiny training settings, a small real-text dataset,
launching one job across the harness's nodes, waiting for a step, and reading the report.

Replays keep the model tiny (2 layers, d=64, seq 64) so a run on 2 cores costs seconds and
the incident, not the arithmetic, dominates it.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any

from steadytrain.testing.nodes import Node, NodeHarness

__all__ = [
    "TINY_SETTINGS",
    "IncidentJob",
    "incident_rows",
    "read_trace",
    "report",
    "reports",
    "small_shards",
    "train_args",
]

# Tiny and fast; MLflow off (opening its store costs seconds of CPU per run on 2 cores).
TINY_SETTINGS = [
    "seed=7",
    "data.seq_len=64",
    "data.global_batch=8",
    "data.micro_batch=2",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "optim.warmup_steps=4",
    "train.threads=1",
    "train.log_every=4",
    "train.deterministic=true",
    "checkpoint.interval=steps",
    "checkpoint.async_mode=thread",
    'monitor.sinks=["jsonl"]',
]

# The keys of one row of a replay's ``incidents``: the report's incident (``steadytrain
# report --json``, steadytrain.diagnose) and ``run``, which of the replay's runs it is from.
ROW_KEYS = ("kind", "nodes", "ranks", "first_step", "last_step", "lost_s", "evidence", "advice")


def small_shards(
    dest: str, *, tokens: int = 150_000, shard_tokens: int = 1024, doc_bytes: int = 1000
) -> str:
    """About ``tokens`` tokens of real text (the stdlib's json and email packages, bytes
    tokenizer) in ``shard_tokens``-token shards, as documents of ~``doc_bytes`` bytes (a
    shard closes at a document boundary). Returns ``dest``."""
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "email", "*.py")))
    tok = {"type": "bytes", "vocab_size": 257, "eos_id": 256}
    total = 0
    with DatasetWriter(
        dest, vocab_size=257, eos_id=256, tokenizer=tok, shard_tokens=shard_tokens
    ) as w:
        for path in files:
            with open(path, "rb") as f:
                text = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
            for doc in np.array_split(text, max(1, text.size // doc_bytes)):
                w.add_document(np.append(doc, 256))
                total += doc.size + 1
            if total >= tokens:
                break
    return dest


def train_args(settings: Sequence[str], module: str = "steadytrain.cli") -> list[str]:
    """``python -m MODULE train demo --set ...`` as torchrun's script arguments (``module``:
    the CLI, or ``steadytrain.testing.naive_loader``, which takes the same arguments)."""
    args = ["-m", module, "train", "demo"]
    for s in settings:
        args += ["--set", s]
    return args


def read_trace(run_dir: str) -> list[dict[str, Any]]:
    """Every trace record of every rank and attempt, in the order each rank wrote them
    (a ``records_lost`` line, left by a failing disk, is not a step: skipped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "trace-rank*.jsonl"))):
        with open(path) as f:
            recs = (json.loads(line) for line in f if line.strip())
            out.extend(r for r in recs if "type" not in r)
    return out


def last_step(run_dir: str) -> int:
    return max((r["step"] for r in read_trace(run_dir)), default=0)


def report(run_dir: str, *, timeout: float = 180, plots: bool = True) -> dict[str, Any]:
    """``steadytrain report RUN_DIR --json`` in a fresh process (as a user runs it);
    ``plots`` False adds ``--no-plots``, for a caller that reads only the numbers."""
    r = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "report", run_dir, "--json"]
        + ([] if plots else ["--no-plots"]),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise RuntimeError(f"steadytrain report {run_dir} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def reports(run_dirs: dict[str, str], *, timeout: float = 180) -> dict[str, dict[str, Any]]:
    """``report`` of every run in ``run_dirs`` (name -> directory) at once, each in its own
    process: a replay's runs are over by then and a report only reads their records, so
    the reports need not wait for each other (a few seconds each, more on a loaded machine)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(run_dirs)) as pool:
        futures = {k: pool.submit(report, d, timeout=timeout) for k, d in run_dirs.items()}
    return {k: f.result() for k, f in futures.items()}


def incident_rows(summary: dict[str, Any], run: str) -> list[dict[str, Any]]:
    """The report's incidents, each tagged with ``run`` (which of the replay's runs). A
    replay never adds a row of its own: what it prints is what the product diagnosed."""
    return [{**i, "run": run} for i in summary.get("incidents", [])]


class IncidentJob:
    """One training job with one torchrun agent per node in ``nodes``; each agent's output
    goes to ``logs/NODE.log``."""

    def __init__(
        self,
        h: NodeHarness,
        nodes: Sequence[Node],
        run_dir: str,
        settings: Sequence[str],
        *,
        nproc: int = 1,
        nnodes: str | None = None,
        max_restarts: int = 0,
        rdzv_conf: str = "",
        env: dict[str, str] | None = None,
        module: str = "steadytrain.cli",
        argv: Sequence[str] | None = None,
    ) -> None:
        self.h, self.nodes, self.run_dir = h, list(nodes), run_dir
        self.logs = run_dir + "-logs"
        os.makedirs(self.logs, exist_ok=True)
        # ``argv``: the script and its arguments, when the job is not ``steadytrain train``
        # (a trainer example); ``settings`` are then not used.
        args = (
            list(argv)
            if argv is not None
            else (train_args([*TINY_SETTINGS, f"run_dir={run_dir}", *settings], module))
        )
        self.argv = args
        # A trainer script's job (argv) keeps fresh agents: the Lightning node-loss case's
        # forked agent twice waited 60 s in its first rendezvous `get` and exited (cause
        # open, docs/testing-log.md); the CLI's jobs fork theirs.
        self.fork_agents: bool | None = False if argv is not None else None
        h.prewarm(self.nodes, args)  # each node's warm process at once (the CLI's ranks fork)
        self.agents = {
            n.name: h.torchrun(
                n,
                nproc,
                args,
                run_id=os.path.basename(run_dir),
                nnodes=nnodes or str(len(self.nodes)),
                max_restarts=max_restarts,
                rdzv_conf=rdzv_conf,
                log_path=self.log_path(n.name),
                env=env,
                fork=self.fork_agents,
            )
            for n in self.nodes
        }

    def log_path(self, node: str) -> str:
        return os.path.join(self.logs, f"{node}.log")

    def tail(self, node: str, chars: int = 6000) -> str:
        try:
            with open(self.log_path(node)) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def check_alive(self, allow_exit: Sequence[str] = ()) -> None:
        """Raise with the node's log if an agent (not in ``allow_exit``) failed."""
        for name, p in self.agents.items():
            rc = p.poll()
            if rc not in (None, 0) and name not in allow_exit:
                raise RuntimeError(f"{name}'s agent exited {rc}:\n{self.tail(name)}")

    def wait_for_step(
        self, step: int, *, timeout: float = 300, allow_exit: Sequence[str] = ()
    ) -> None:
        deadline = time.monotonic() + timeout
        while last_step(self.run_dir) < step:
            self.check_alive(allow_exit)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir}: step {step} not reached in {timeout:.0f} s")
            time.sleep(0.05)

    def wait(
        self, *, timeout: float = 300, expect: dict[str, int | None] | None = None
    ) -> dict[str, int | None]:
        """Wait for every agent; ``expect``: node -> exit code required (None: any). Agents
        not named must exit 0."""
        expect = expect or {}
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for name, p in self.agents.items():
            try:
                codes[name] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"{name}'s agent still running after {timeout:.0f} s:\n{self.tail(name)}"
                ) from None
            want = expect.get(name, 0)
            if name in expect and want is None:
                continue
            if codes[name] != want:
                raise RuntimeError(
                    f"{name}'s agent exited {codes[name]}, expected {want}:\n{self.tail(name)}"
                )
        return codes


def run_summary(run_dir: str, rep: dict[str, Any]) -> dict[str, Any]:
    """What a replay's ``runs`` entry shows of one run."""
    return {
        "run_dir": run_dir,
        "report_html": rep.get("html"),
        "goodput": rep.get("goodput"),
        "attempts": rep.get("attempts"),
        "total_s": rep.get("total_s"),
    }


Log = Callable[[str], None]


def goodput_after_startup(run_dir: str) -> float | None:
    """The report's goodput over the run's wall time less its first start-up (imports,
    process group, model build: ``startup_s`` of the first ``job_start``). A replay runs
    tens of steps, so its first start-up (seconds, and noisy on a loaded machine) would
    otherwise decide the comparison; a real run amortises it over weeks. Later start-ups
    (restarts after the incident) stay in: they are the incident's cost. None without a
    report."""
    from steadytrain.monitor.ledger import read_ledger

    try:
        with open(os.path.join(run_dir, "report", "report.json")) as f:
            rep = json.load(f)
        records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    except (OSError, ValueError):
        return None
    first = next((r for r in records if r.get("type") == "job_start"), None)
    lead = float((first or {}).get("startup_s") or 0.0)
    window = float(rep.get("total_s") or 0.0) - lead
    return float(rep["goodput_s"]) / window if window > 0 else None
