"""The demo's training stage: 2 ranks under torchrun, crashes injected, automatic resume.

``run_demo_training(run_dir, dataset)`` launches ``torchrun --nproc-per-node 2
--max-restarts N -m steadytrain.cli train demo`` on CPU, injects a crash in the middle of a
step and another one while a checkpoint is being written, lets torchrun restart the ranks
(each restart resumes from the newest committed checkpoint by itself), and returns what
happened, measured from the run's own ledger::

    {"run_dir", "steps", "restarts", "goodput", "report", "ledger", "crashes", "wall_s",
     "mlflow"}

MLflow is on (``configs/demo.toml``): ``mlflow`` is ``{"tracking_uri", "ui", "ui_package"}``
for the run's ``RUN_DIR/mlflow.db``, or None when the MLflow extra is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from steadytrain.testing.ports import free_ports

__all__ = ["run_demo_training", "demo_crash_steps", "train_entry"]


def demo_crash_steps(steps: int, every_steps: int) -> tuple[int, int]:
    """(mid-step crash, crash during a save): one third and two thirds into the run.

    The mid-step crash lands just before a checkpoint would commit (the most work lost); the
    second one is on a checkpoint step, right after that save started writing.
    """
    kill = max(2, (steps // 3) // every_steps * every_steps + every_steps - 1)
    save_kill = max(every_steps, (2 * steps // 3) // every_steps * every_steps)
    if save_kill <= kill:
        save_kill = (kill // every_steps + 1) * every_steps
    return kill, min(save_kill, steps - 1)


def train_entry() -> str:
    """The CLI's file with a training process's lazy imports made top-level
    (``steadytrain/inplace/train_entry.py``): what a keeper or a warm process preloads."""
    import steadytrain.inplace

    return os.path.join(os.path.dirname(steadytrain.inplace.__file__), "train_entry.py")


def _entry(inplace: bool, warm: str | None) -> list[str]:
    """What torchrun starts for each rank: the CLI; the keeper running ``train_entry()``;
    or, with a warm process's socket, its entry, which has the rank forked from there."""
    if inplace:
        return ["-m", "steadytrain.inplace.keeper", train_entry()]
    if warm:
        return ["-m", "steadytrain.warm.enter", train_entry()]
    return ["-m", "steadytrain.cli"]


def run_demo_training(
    run_dir: str,
    dataset: str,
    *,
    steps: int = 300,
    nproc: int = 2,
    every_steps: int = 20,
    crashes: Sequence[int] | None = None,
    save_crashes: Sequence[int] | None = None,
    max_restarts: int = 4,
    settings: Sequence[str] = (),
    out: Callable[[str], None] | None = print,
    timeout_s: float = 600.0,
    inplace: bool = False,
    warm: str | None = None,
) -> dict[str, Any]:
    """Train the demo model under torchrun with injected crashes; returns the outcome.

    ``crashes``: steps at which rank 0 is SIGKILLed mid-step; ``save_crashes``: checkpoint
    steps at which rank 0 is SIGKILLed while that save is in flight (default: one of each, see
    ``demo_crash_steps``). ``settings``: extra ``--set key=value`` overrides. Output lines of
    the ranks and of torchrun's agent go to ``out`` (None: silent). ``inplace``: every rank
    runs under the keeper (``steadytrain.inplace.keeper``) with ``recovery.inplace`` on, so a
    killed rank is replaced in place and the survivor keeps its process (docs/operations.md,
    "In-place recovery"); torchrun's whole restart stays the fallback. ``warm``: the socket
    of a warm process started for ``train_entry()`` (``steadytrain warm --socket PATH
    ENTRY``): every rank of every attempt is forked from it (docs/operations.md, "A warm
    spare"); ignored with ``inplace``, whose keeper preloads by itself.
    """
    from steadytrain.errors import SteadyError

    if crashes is None or save_crashes is None:
        kill, save_kill = demo_crash_steps(steps, every_steps)
        crashes = [kill] if crashes is None else crashes
        save_crashes = [save_kill] if save_crashes is None else save_crashes
    for s in save_crashes:
        if s % every_steps:
            raise SteadyError(f"save crash at step {s} is not a checkpoint step ({every_steps})")
    os.makedirs(run_dir, exist_ok=True)
    faults = ";".join(
        part
        for part in (
            "kill_at_steps=" + ",".join(map(str, crashes)) if crashes else "",
            "kill_in_save_at_steps=" + ",".join(map(str, save_crashes)) if save_crashes else "",
        )
        if part
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_ports(1)[0]}",
        "--monitor-interval=0.2",
        *_entry(inplace, warm),
        "train",
        "demo",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        f"data.dataset={dataset}",
        "--set",
        f"train.max_steps={steps}",
        "--set",
        f"checkpoint.every_steps={every_steps}",
    ]
    if inplace:  # snapshots in memory every 5 steps: a mid-step fault redoes at most 4
        cmd += ["--set", "recovery.inplace=true", "--set", "recovery.every_steps=5"]
    for s in settings:
        cmd += ["--set", s]
    env = dict(
        os.environ,
        STEADYTRAIN_FAULTS=faults,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if warm and not inplace:
        env["STEADYTRAIN_WARM_SOCKET"] = warm
    if not inplace:
        # Fresh rendezvous store per attempt: the shared one breaks restarts (pytorch#135712).
        # In place, the keeper needs the shared one; its groups use per-attempt prefixes.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    say = out or (lambda _line: None)
    say(
        f"[demo] torchrun: {nproc} ranks on CPU, {steps} steps, async checkpoint every "
        f"{every_steps} steps; crashes injected at step(s) {list(crashes)} (mid-step) and "
        f"{list(save_crashes)} (while the checkpoint is written)"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    tail: list[str] = []
    present = _Presenter()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-60:]
            shown = present(line)
            if shown:
                say(shown)
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                raise SteadyError(f"demo training exceeded {timeout_s:.0f}s; see {run_dir}")
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall_s = time.perf_counter() - t0
    if rc != 0:
        raise SteadyError(
            f"demo training failed (torchrun exit {rc}); last output:\n" + "\n".join(tail)
        )
    return _summarise(run_dir, wall_s, list(crashes) + list(save_crashes))


_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_PEER = re.compile(r"\[rank(\d+)\]: RuntimeError: .*(Connection closed by peer|Connection reset)")


class _Presenter:
    """Keeps the lines a person wants (progress, faults, restarts); drops launcher noise.

    One failure makes torchrun log every rank's exit; only the first is worth a line.
    """

    def __init__(self) -> None:
        self.failure_told = False

    def __call__(self, line: str) -> str | None:
        if line.startswith("[train] attempt"):
            self.failure_told = False
        if line.startswith(("[train]", "[fault]")):
            return line
        if line.startswith("steadytrain.inplace: "):  # the keeper: in place, or why not
            return "[keeper] " + line[len("steadytrain.inplace: ") :]
        if line.startswith("steadytrain.warm: "):  # a rank started cold, and why
            return "[warm] " + line[len("steadytrain.warm: ") :]
        if line.startswith("steadytrain train: error:"):
            return "[error] " + line[len("steadytrain train: error:") :].strip()
        m = _EXIT.search(line)
        if m and not self.failure_told:
            self.failure_told = True
            code = int(m.group(1))
            how = "was killed (SIGKILL)" if code == -9 else f"exited with status {code}"
            return (
                f"[torchrun] local rank {m.group(2)} {how}: torchrun stops the other ranks and "
                "restarts them; every rank resumes from the newest committed checkpoint"
            )
        m = _PEER.search(line)
        if m:
            return f"[train] rank {m.group(1)}: lost its peer in a collective (the other rank died)"
        if "checkpoint of step" in line and "failed" in line:
            return (
                "[train] " + line.split(":")[0].strip() + ": it never committed, so it is ignored"
            )
        return None


def _summarise(run_dir: str, wall_s: float, crashes: list[int]) -> dict[str, Any]:
    """What happened, in the report's own numbers: ``goodput`` and ``breakdown`` are
    ``steadytrain report``'s (its one ``Breakdown``, ``straggler_wait`` and the other
    buckets only the report sees included), so the demo never prints a second figure."""
    from steadytrain.monitor.ledger import read_ledger

    path = os.path.join(run_dir, "ledger.jsonl")
    records = read_ledger(path)
    starts = [r for r in records if r.get("type") == "job_start"]
    report = _write_report(run_dir)
    return {
        "run_dir": run_dir,
        "steps": report["last_step"],
        "restarts": max(0, len(starts) - 1),
        "restored_steps": [r.get("restored_step", 0) for r in starts[1:]],
        "crashes": crashes,
        "goodput": report["goodput"],
        "breakdown": {k: report[k] for k in BREAKDOWN_KEYS if k in report},
        "job_state": report.get("job_state"),
        # each recovery: in place or whole restart, why, its phases (report/recoveries.py)
        "recoveries": report.get("recoveries") or [],
        "report": report.get("html") or report.get("json"),
        "report_json": report.get("json"),
        "ledger": path,
        "wall_s": wall_s,
        "mlflow": _mlflow_info(run_dir),
    }


# The report's breakdown keys the demo returns (``Breakdown.to_dict``'s, less the per-attempt
# detail: the report's JSON has that).
BREAKDOWN_KEYS = (
    "goodput",
    "goodput_s",
    "total_s",
    "badput_s",
    "badput",
    "attempts",
    "restarts",
    "steps_recorded",
    "steps_kept",
    "steps_lost",
    "tokens_kept",
    "last_step",
    "recovery_point_age_s",
    "slowdown_unmeasured_steps",
    "overbooked_s",
    "checkpoints",
    "checkpoints_reconciled",
)


def _mlflow_info(run_dir: str) -> dict[str, str] | None:
    """Where the run's MLflow store is and the command that opens it (None: MLflow off)."""
    from steadytrain.monitor.mlflow_sink import UI_PACKAGE, ui_command

    db = os.path.abspath(os.path.join(run_dir, "mlflow.db"))
    if not os.path.exists(db):
        return None
    return {"tracking_uri": f"sqlite:///{db}", "ui": ui_command(run_dir), "ui_package": UI_PACKAGE}


def _write_report(run_dir: str) -> dict[str, Any]:
    """The goodput report (``steadytrain report``'s HTML page, plots and report.json)."""
    from steadytrain.report.build import build_report

    return build_report(run_dir)
