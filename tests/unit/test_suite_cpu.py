"""scripts/suite_cpu.py: the per-test CPU the suite's profile reports counts a test's child
processes (where most of the suite's CPU is spent) and nothing of the tests beside it; its
``--workers`` view says when each worker ended and when its longest test started."""

from __future__ import annotations

import importlib.util
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


def _suite_cpu():
    spec = importlib.util.spec_from_file_location(
        "suite_cpu", os.path.join(REPO, "scripts", "suite_cpu.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_workers_names_each_workers_end_its_longest_test_and_when_it_started(
    tmp_path, monkeypatch, capsys
) -> None:
    rows = {
        "gw0": [
            {"id": "t.py::first", "cpu_s": 1.0, "wall_s": 2.0},
            {"id": "t.py::long", "cpu_s": 0.25, "wall_s": 10.0},
            {"id": "t.py::last", "cpu_s": 0.25, "wall_s": 0.25},
        ],
        "gw1": [{"id": "u.py::only", "cpu_s": 3.0, "wall_s": 4.0}],
    }
    for name, rs in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    monkeypatch.setattr(sys, "argv", ["suite_cpu.py", str(tmp_path), "--workers"])
    _suite_cpu().main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["gw0", "3", "2", "12"]  # tests, CPU, ends at 12.25 s
    assert lines[1].endswith("t.py::long (10.0, 2); t.py::last (0.2)"), lines[1]
    assert lines[2].split()[:4] == ["gw1", "1", "3", "4"]
    assert lines[2].endswith("u.py::only (4.0, 0); u.py::only (4.0)"), lines[2]
