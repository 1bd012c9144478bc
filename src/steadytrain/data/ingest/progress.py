"""A progress bar on stderr (rich), silent when stderr is not a terminal or when asked.

Both ``tokenize`` (bytes read, tokens/s) and ``verify`` (bytes checked) use it; the library
functions take a ``Progress``-like object so tests and scripts pass ``NullProgress()``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["NullProgress", "BarProgress", "make_progress"]


class NullProgress:
    """Does nothing; the default for library calls."""

    def start(self, total: int | None, description: str) -> None:
        pass

    def update(self, completed: int, tokens: int | None = None) -> None:
        pass

    def stop(self) -> None:
        pass


class BarProgress(NullProgress):
    """A rich bar over bytes, with a tokens/s figure when tokens are reported."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._t0 = 0.0

    def start(self, total: int | None, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, rate="")
        self._t0 = time.perf_counter()

    def update(self, completed: int, tokens: int | None = None) -> None:
        if self._bar is None:
            return
        rate = ""
        if tokens is not None:
            dt = max(time.perf_counter() - self._t0, 1e-9)
            rate = f"{tokens / 1e6:.1f} M tok, {tokens / dt / 1e6:.2f} M tok/s"
        self._bar.update(self._task, completed=completed, rate=rate)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def make_progress(quiet: bool = False) -> NullProgress:
    """A bar when stderr is a terminal and not ``quiet``; otherwise silence."""
    if quiet or not sys.stderr.isatty():
        return NullProgress()
    return BarProgress()
