"""``MeterConfig``: a ``GoodputMeter``'s settings, their defaults and their one check.

Kept apart from the meter itself so the training config (``[monitor]``) and the library
share one definition without the meter's machinery.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from steadytrain.monitor.alerts import AlertConfig, _band
from steadytrain.monitor.sinks import SINKS
from steadytrain.monitor.watchdog_config import WatchdogConfig
from steadytrain.settings import check

__all__ = ["MeterConfig"]


@dataclasses.dataclass(kw_only=True)
class MeterConfig:
    """A ``GoodputMeter``'s settings and their one check (``[monitor]`` in a training config);
    the run directory, rank and run length are the run's, passed apart."""

    # Per GPU: (low, high), or x meaning "at least 0.9 x"; None or 0: learn it (alerts).
    expected_tokens_per_s: float | tuple[float, float] | None = None
    sinks: list[Any] = dataclasses.field(default_factory=lambda: ["jsonl"])  # names or objects
    tracking_uri: str | None = None  # MLflow (None: sqlite in RUN_DIR)
    experiment: str = "steadytrain"  # MLflow experiment
    memory_every: int = 1  # sample RSS and /dev/shm every N steps
    flush_interval_s: float = 0.25  # the background writer's batching period
    sink_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. window_s
    snapshot_every: int = 1000  # ledger records between restart snapshots
    per_rank: bool = True  # every rank writes RUN_DIR/ranks/rank-RRRRR.jsonl
    straggler_every_s: float = 5.0  # rank 0 reads the rank files this often (0: never)
    # SIGTERM while the loop is stuck in a C++ call (a collective whose peer stopped): after
    # this many seconds without the loop reacting, Run records the crash and exits 143
    # (run_stuck.py); 0: never (wait for the launcher's SIGKILL, as before issue 44)
    sigterm_exit_s: float = 2.0
    alerts: AlertConfig = dataclasses.field(default_factory=AlertConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)  # hangs

    def __post_init__(self) -> None:
        if self.expected_tokens_per_s == 0:
            self.expected_tokens_per_s = None  # TOML cannot say None: 0 means "learn it"
        _band(self.expected_tokens_per_s)  # the alerts' own check
        self.sinks = list(self.sinks)  # any iterable given: it is read again when opening
        for spec in self.sinks:
            ok = spec in SINKS if isinstance(spec, str) else hasattr(spec, "write")
            check(ok, "sinks", spec, f"use {sorted(SINKS)} or an object with write() and close()")
        check(self.memory_every >= 1, "memory_every", self.memory_every, "use 1 or more steps")
        check(self.flush_interval_s > 0, "flush_interval_s", self.flush_interval_s, "use > 0")
        check(self.snapshot_every >= 1, "snapshot_every", self.snapshot_every, "use 1 or more")
        check(self.straggler_every_s >= 0, "straggler_every_s", self.straggler_every_s, ">= 0")
        check(self.sigterm_exit_s >= 0, "sigterm_exit_s", self.sigterm_exit_s, "use >= 0")
