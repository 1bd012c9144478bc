"""The record folders import in one direction: monitor/ -> diagnose/ -> report/ -> planning/.

``monitor/`` holds the record formats and the live machinery that writes them (and the
window judgment the live straggler check shares with the engine); ``diagnose/`` is a pure
function of those records; ``report/`` reads a run's records once; ``planning/`` sits on
top (``plan --from-run`` prices a run from the report's numbers). Every
import counts, including those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import steadytrain

SRC = Path(steadytrain.__file__).parent
LAYERS = ["monitor", "diagnose", "report", "planning"]  # bottom to top


def _imported(path: Path) -> set[str]:
    """The steadytrain sub-packages ``path`` imports (``steadytrain.X...`` -> X)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "steadytrain" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_no_record_folder_imports_one_above_it(layer: str) -> None:
    above = set(LAYERS[LAYERS.index(layer) + 1 :])
    offenders = {
        f"{path.relative_to(SRC)}: {sorted(_imported(path) & above)}"
        for path in sorted((SRC / layer).rglob("*.py"))
        if _imported(path) & above
    }
    assert offenders == set()


def test_the_check_sees_a_lazy_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from steadytrain.report.build import build_report\n")
    assert _imported(bad) == {"report"}
