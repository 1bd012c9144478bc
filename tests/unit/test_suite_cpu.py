"""scripts/suite_cpu.py: the per-test CPU the suite's profile reports counts a test's child
processes (where most of the suite's CPU is spent) and nothing of the tests beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TESTS = """
import subprocess, sys

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"


def test_child_burns():
    subprocess.run([sys.executable, "-c", BURN], check=True)


def test_idle():
    pass
"""


def test_a_child_process_cpu_is_counted_in_its_test_alone(tmp_path) -> None:
    (tmp_path / "test_burn.py").write_text(TESTS)
    out = tmp_path / "cpu"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "scripts"), SUITE_CPU_DIR=str(out))
    env.pop("PYTEST_XDIST_WORKER", None)  # the inner pytest is no worker: its rows go to main
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "suite_cpu", "--rootdir", str(tmp_path), str(tmp_path / "test_burn.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {
        json.loads(line)["id"].split("::")[1]: json.loads(line)
        for line in (out / "main.jsonl").read_text().splitlines()
    }
    # The child's 0.6 s of its own CPU (process time, which load does not stretch).
    assert rows["test_child_burns"]["cpu_s"] >= 0.55, rows
    assert rows["test_idle"]["cpu_s"] < 0.3, rows
    s = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "suite_cpu.py"), str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("2 tests,"), s.stdout
    assert "test_burn.py::test_child_burns" in s.stdout.split("by test")[1].splitlines()[2]
