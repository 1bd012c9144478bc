"""`steadytrain train` alone (no torchrun): a SIGKILLed run resumes by itself on the next
start and ends with the same weights (SHA-256 in final.json) and per-step losses as an
uninterrupted run; a bad --set value fails before any work with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from steadytrain.testing import forkserver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, effective, make_dataset, read_trace  # noqa: E402

# Three `train` runs of up to 100 s each (their own timeouts) under a loaded machine: 120 s
# for the whole test timed out at load ~20 (CI runs 4 workers on 2 cores).
pytestmark = pytest.mark.timeout(360)


def _train(run_dir: str, dataset: str, faults: str = "", *extra: str):
    cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
    for s in [*BASE_SETTINGS, f"run_dir={run_dir}", f"data.dataset={dataset}", *extra]:
        cmd += [s] if s.startswith("--") else ["--set", s]  # a flag, or a setting
    env = dict(os.environ, STEADYTRAIN_FAULTS=faults, OMP_NUM_THREADS="1")
    return forkserver.run(cmd, env=env, timeout=100)


def test_alone_crash_then_restart_resumes_exactly(tmp_path) -> None:
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=100_000)
    ref = _train(str(tmp_path / "ref"), ds, "", "train.max_steps=10")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = str(tmp_path / "run")
    crashed = _train(run, ds, "kill_at_steps=7", "train.max_steps=10")
    assert crashed.returncode == -9  # SIGKILL mid-step 7; the checkpoint of step 4 survives
    resumed = _train(run, ds, "kill_at_steps=7", "train.max_steps=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr  # progress is on stderr
    with open(os.path.join(run, "final.json")) as f, open(tmp_path / "ref" / "final.json") as g:
        assert json.load(f)["weights"] == json.load(g)["weights"]
    got, want = effective(read_trace(run)), effective(read_trace(str(tmp_path / "ref")))
    assert [got[s]["loss"] for s in range(1, 11)] == [want[s]["loss"] for s in range(1, 11)]


def test_bad_setting_fails_fast_with_a_clear_message(tmp_path) -> None:
    bad = _train(str(tmp_path / "x"), str(tmp_path / "nowhere"), "", "optim.lr=-1")
    assert bad.returncode == 2
    assert "optim.lr = -1.0 is invalid: use a positive learning rate" in bad.stderr
    assert not os.path.exists(tmp_path / "x")  # nothing was created


def test_json_stdout_is_only_the_summary_and_a_closed_pipe_is_quiet(tmp_path) -> None:
    """``train --json``: stdout is one JSON object (progress goes to stderr); a reader that
    closes the pipe early (``| head -1``) ends the command without a traceback."""
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run = _train(str(tmp_path / "run"), ds, "", "train.max_steps=4", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)  # fails if any progress line is mixed in
    assert summary["step"] == 4
    assert "[train] step" in run.stderr
    cmd = [sys.executable, "-m", "steadytrain.cli", "plan", "--gpus", "512", "--json"]
    piped = subprocess.run(
        f"{' '.join(cmd)} | head -c 1", shell=True, capture_output=True, text=True, timeout=60
    )
    assert piped.stdout == "{"
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
