"""The run report, on top of the record folders: ``monitor/`` (the record formats and the live
machinery that writes them) -> ``diagnose/`` (incidents, a pure function of the records) ->
``report/``. Nothing below imports this package (tests/unit/test_layers.py checks it).

``build_report`` is imported on first use: ``import steadytrain.report.restores`` (the
planner's) must not pay for the whole report and its plots.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_report"]


def __getattr__(name: str) -> Any:
    if name == "build_report":
        from steadytrain.report.build import build_report

        globals()["build_report"] = build_report
        return build_report
    raise AttributeError(f"module 'steadytrain.report' has no attribute {name!r}")
