"""The README's plain PyTorch example, extracted and run as written, so it cannot rot.

It must stay 15 lines or fewer, train to step 200 with committed checkpoints, and resume:
with its newest checkpoint removed (as if the job had died before it), a second run
continues from the one before and commits step 200 again, leaving older ones untouched.
Its ``steadytrain.Run`` keeps the ledger: two attempts, the second restored at step 150,
both ended cleanly. (The same loop under torchrun with a killed rank and a hung rank:
test_run_plain_pytorch.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def readme_block() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    m = re.search(r"^Plain PyTorch, crash-safe.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, "README.md lost its 'Plain PyTorch, crash-safe' example"
    return m.group(1)


def committed(ckpts: str) -> dict[int, float]:
    """Committed step -> mtime of its COMMIT, from `steadytrain checkpoints --json`."""
    out = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "checkpoints", ckpts, "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)["checkpoints"]
    return {
        r["step"]: os.path.getmtime(os.path.join(r["path"], "COMMIT"))
        for r in rows
        if r["state"] == "committed" and r["verifies"]
    }


def test_readme_plain_pytorch_example_runs_and_resumes(dataset: str, tmp_path) -> None:
    code = readme_block()
    assert len(code.strip().splitlines()) <= 15, "the README promises 15 lines or fewer"
    shutil.copytree(dataset, tmp_path / "my-dataset")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    run()
    first = committed(str(tmp_path / "ckpts"))
    assert max(first) == 200 and 150 in first, first
    shutil.rmtree(tmp_path / "ckpts" / "step-00000200")
    run()  # resumes from step 150
    second = committed(str(tmp_path / "ckpts"))
    assert max(second) == 200
    assert second[150] == first[150], "step 150 was saved again: the run did not resume"
    from steadytrain.monitor.ledger import read_ledger

    recs = read_ledger(str(tmp_path / "run" / "ledger.jsonl"))
    starts = [r["restored_step"] for r in recs if r["type"] == "job_start"]
    ends = [r["reason"] for r in recs if r["type"] == "job_end"]
    assert starts == [0, 150] and ends == ["finished", "finished"], (starts, ends)
    assert [r["step"] for r in recs if r["type"] == "step"][-1] == 200
