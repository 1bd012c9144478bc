"""``./run.sh quick`` and ``./run.sh test`` start pytest with byte-code caches on.

A shell that sets ``PYTHONDONTWRITEBYTECODE`` made every worker of every run redo pytest's
assertion rewriting of every test module (~8 s of CPU per worker, docs/testing-log.md, "Sixth
pass"). run.sh runs here as written, in a copy of the repository's top whose ``.venv``
holds a stand-in ``python`` that reports its arguments and environment (the set-up is
skipped: its stamp is there), so no test suite runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!{python}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "dont_write": os.environ.get("PYTHONDONTWRITEBYTECODE")}}))
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in ("run.sh", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    digest = hashlib.sha1(
        (ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()
    ).hexdigest()[:12]
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / ".venv" / f".installed-{digest}").touch()  # run.sh's set-up: done already
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("command", ["quick", "test"])
def test_run_sh_starts_pytest_with_bytecode_caches_on(repo: Path, command: str) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "STEADYTRAIN_TEST_WORKERS": "3"}
    env.pop("STEADYTRAIN_VENV", None)
    p = subprocess.run(
        ["bash", str(repo / "run.sh"), command, "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["dont_write"] is None, got  # unset for pytest and everything it starts
    assert got["argv"][:4] == ["-m", "pytest", "-n", "3"], got  # the workers' count reached it
    assert got["argv"][-1] == "-q"
