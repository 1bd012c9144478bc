"""The test command collects every test file on disk.

pytest's default ``norecursedirs`` skips any directory named ``dist``, ``build`` or
``venv``: the multi-process tests once lived in ``tests/dist/`` and ran only when named on
the command line, never in ``./run.sh test`` or CI. This test runs the suite's own
collection, as the test command does (no paths: ``testpaths``), and asks that every
``test_*.py`` under ``tests/`` contributes tests or says why it skipped.

A session that itself collected from ``testpaths`` (``./run.sh test``, ``./run.sh quick``,
CI: no paths given) has just done that collection, with the same configuration: the test
reads it (``session_collection`` in tests/conftest.py, recorded before ``-m``/``-k``
deselect) instead of paying a second whole collection (~20 s of CPU: every test module,
torch included). Run on its own (a path given), it starts that collection itself.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _collect() -> tuple[set[str], set[str]]:
    """The test command's collection, in a pytest of its own: (files that gave tests,
    modules that skipped themselves)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    # A module that skips itself (a missing optional package) is named in the -rs summary.
    skipped = {
        f for f in glob.glob("tests/**/test_*.py", root_dir=REPO, recursive=True)
        if f in out.stdout and f not in collected
    }  # fmt: skip
    return collected, skipped


def test_every_test_file_is_collected_by_the_test_command(session_collection) -> None:
    collected, skipped = session_collection or _collect()
    on_disk = set(glob.glob("tests/**/test_*.py", root_dir=REPO, recursive=True))
    assert len(on_disk) > 50  # the glob itself works
    missing = sorted(on_disk - collected - skipped)
    assert missing == [], f"never collected by the test command: {missing}"
