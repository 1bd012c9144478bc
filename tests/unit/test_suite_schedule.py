"""The suite's parallel schedule (tests/conftest.py), run on a small suite of its own.

A copy of tests/conftest.py beside folders named as the suite's (``nodes``, ``unit``) runs
under ``pytest -n 3`` as ``./run.sh test`` does; each test notes its worker and when it ran.
Checked: every node-harness or ``machine`` test runs on one worker, never two at once; a
module whose tests share a module-scoped fixture runs on one worker (the fixture is built
once); the rest spreads over the workers; the folder marks select the inner loop; and a run
that selects nothing still exits 5, which CI fails on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

NOTE = textwrap.dedent(
    """
    import json, os, time

    def note(name, sleep=0.3):
        start = time.monotonic()
        time.sleep(sleep)
        with open(os.environ["SCHEDULE_LOG"], "a") as f:
            f.write(json.dumps({"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                                "start": start, "end": time.monotonic()}) + "\\n")
    """
)


def _suite(root: Path) -> None:
    (root / "tests").mkdir()
    shutil.copy(CONFTEST, root / "tests" / "conftest.py")
    (root / "tests" / "note.py").write_text(NOTE)
    (root / "pytest.ini").write_text(
        "[pytest]\naddopts = -p no:cacheprovider --import-mode=importlib\n"
        "markers =\n    nodes: x\n    e2e: x\n    packaging: x\n    s3: x\n    dist: x\n"
    )
    head = (
        "import sys, pytest\nsys.path.insert(0, __import__('os').path.dirname(__file__) + '/..')\n"
    )
    head += "from note import note\n"
    files = {
        "nodes/test_harness.py": "".join(
            f"def test_h{i}():\n    note('nodes-{i}')\n" for i in range(4)
        ),
        "unit/test_timed.py": "@pytest.mark.machine\ndef test_deadline():\n    note('machine')\n",
        "unit/test_shared.py": (
            "@pytest.fixture(scope='module')\ndef built():\n    note('built', 0)\n    return 1\n"
            + "".join(f"def test_s{i}(built):\n    note('shared-{i}')\n" for i in range(3))
        ),
        "unit/test_plain.py": "".join(
            f"def test_p{i}():\n    note('plain-{i}')\n" for i in range(6)
        ),
    }
    for name, body in files.items():
        path = root / "tests" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(head + body)


def _run(root: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = root / f"log-{len(list(root.glob('log-*')))}.jsonl"
    log.touch()
    env = {**os.environ, "SCHEDULE_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)
    # Only xdist among the venv's plugins: each worker starts in a second, not ten.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist", *args], cwd=root, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out, [json.loads(line) for line in log.read_text().splitlines()]


def test_machine_tests_share_one_worker_and_never_overlap(tmp_path) -> None:
    _suite(tmp_path)
    out, notes = _run(tmp_path, "-n", "3", "tests")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "14 passed" in out.stdout
    by = {n["test"]: n for n in notes}
    machine = [by[f"nodes-{i}"] for i in range(4)] + [by["machine"]]
    assert len({n["worker"] for n in machine}) == 1, machine
    spans = sorted((n["start"], n["end"]) for n in machine)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert len({by[f"shared-{i}"]["worker"] for i in range(3)}) == 1
    assert sum(1 for n in notes if n["test"] == "built") == 1  # built once, not per worker
    plain_workers = {by[f"plain-{i}"]["worker"] for i in range(6)}
    assert len(plain_workers) >= 2, "the independent tests did not spread over the workers"


def test_folder_marks_select_the_inner_loop_and_nothing_selected_exits_5(tmp_path) -> None:
    _suite(tmp_path)
    out, notes = _run(tmp_path, "-n", "2", "-m", "not nodes and not e2e and not packaging")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not any(n["test"].startswith("nodes-") for n in notes)
    assert any(n["test"] == "machine" for n in notes)
    out, _ = _run(tmp_path, "-n", "2", "-m", "e2e")
    assert out.returncode == 5, out.stdout[-3000:]


# A test module starts torchrun when it names the launcher or one of the suite's helpers that
# run it (tests/e2e/train/harness.py, tests/integrations/example_runs.py, NodeHarness).
LAUNCHES_TORCHRUN = re.compile(
    r"torch\.distributed\.run|\b(start_example|run_pair|run_kills|torchrun_cmd|start_torchrun"
    r"|run_torchrun|start_agent|start_inplace)\(|\.torchrun\("
)
# Modules that name the launcher without starting it.
NAMES_TORCHRUN_ONLY = {"unit/test_slurm_sbatch.py": "reads an sbatch script's srun line"}
MARKED = re.compile(r"pytestmark\s*=.*pytest\.mark\.(e2e|nodes)|marks=pytest\.mark\.e2e")


def test_every_module_that_starts_torchrun_is_marked_e2e() -> None:
    """The inner loop (``./run.sh quick``: not nodes, e2e or packaging) leaves the torchrun
    end-to-end runs out: a test that starts torchrun outside tests/e2e and tests/nodes says
    ``e2e`` itself, for its module (``pytestmark``) or for its case (``pytest.param(...,
    marks=pytest.mark.e2e)``)."""
    tests = CONFTEST.parent
    unmarked = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests).as_posix()
        if rel.split("/")[0] in ("e2e", "nodes") or rel in NAMES_TORCHRUN_ONLY:
            continue
        text = path.read_text(encoding="utf-8")
        if LAUNCHES_TORCHRUN.search(text) and not MARKED.search(text):
            unmarked.append(rel)
    assert not unmarked, f"start torchrun but are not marked e2e (./run.sh quick): {unmarked}"
