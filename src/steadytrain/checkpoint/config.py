"""``CheckpointerConfig``: everything a ``Checkpointer`` can be told, checked once.

Its own module so the training config (``train/config.py``) composes it without importing
the checkpointer's machinery; ``steadytrain.checkpoint.checkpointer`` re-exports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from steadytrain.checkpoint.lease import DEFAULT_TIMEOUT_S
from steadytrain.checkpoint.memory.config import MemoryConfig
from steadytrain.settings import check, check_choices, from_table

__all__ = ["CheckpointerConfig"]


@dataclasses.dataclass(kw_only=True)
class CheckpointerConfig:
    """Everything a ``Checkpointer`` can be told, with the one copy of each default and
    check. The ``[checkpoint]`` table of a training config is this plus ``dir``/``engine``."""

    every_steps: int = 0  # save when step % every_steps == 0 (0: not by steps)
    every_seconds: float = 0.0  # save after this much wall time (0: not by time)
    # None: "seconds" when only every_seconds is set, else "steps" (0 steps: call save()).
    # "auto": the planner's optimum from the measured save cost and mtbf_s.
    interval: Literal["steps", "seconds", "auto"] | None = None
    # At least 2, never 1: a checkpoint can be found damaged after its commit (a bad disk, a
    # truncated copy), and restore then falls back to the next older committed one. With
    # keep_last = 1 there is none, and one bad file sends the job back to step 0.
    keep_last: int = 3
    keep_every: int = 0  # also keep every step that is a multiple of this (0: none)
    async_mode: Literal["sync", "thread", "process"] = "thread"
    # How a tensor lies in a shard file: "raw", its bytes (one write() each: the background
    # writer holds the GIL the training thread needs for ~1/10 as long), or "torch_save",
    # DCP's own per-tensor archive, for readers without steadytrain (plain dcp.load).
    tensor_format: Literal["raw", "torch_save"] = "raw"
    # Raw format, sync/thread modes: once DCP has planned a layout, write the saves that
    # repeat it from that plan (the same files; repeat_save.py). False: DCP plans every save.
    reuse_plans: bool = True
    remote: str = ""  # an s3://... copy of every committed checkpoint ("": none)
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # for remote
    mtbf_s: float = 0.0  # the job's mean time between failures, for interval = "auto"
    restart_s: float = 0.0  # the job's restart cost, for interval = "auto"
    # "full", the safe one: every checksum is checked before any live tensor is written, so
    # a damaged checkpoint never touches the caller's state, whatever that state is (a
    # restore into a live model too). "overlap" hashes while the bytes stream into place
    # (one read, faster) and is only safe onto freshly built state: the packaged training
    # configs choose it explicitly because the loop restores at start-up.
    verify: Literal["full", "overlap"] = "full"
    # The writer lease (docs/checkpoint.md): who this job is across restarts ("": from
    # TORCHELASTIC_RUN_ID or SLURM_JOB_ID), and when a silent holder counts as dead.
    job_id: str = ""
    lease_timeout_s: float = DEFAULT_TIMEOUT_S
    # The memory tier (``[checkpoint.memory]``): recovery points every K steps in node-local
    # memory and on a peer's node, restored before durable ones when newer (memory/).
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        check_choices(self)
        if isinstance(self.memory, dict):  # a nested table given as a dict (Run's checkpoint=)
            self.memory = from_table(MemoryConfig, self.memory, "memory")
        check(
            isinstance(self.memory, MemoryConfig),
            "memory",
            self.memory,
            "give a MemoryConfig or a table of its keys, e.g. {every_steps = 1}",
        )
        if self.interval is None:
            only_time = self.every_seconds and not self.every_steps
            self.interval = "seconds" if only_time else "steps"
        check(self.every_steps >= 0, "every_steps", self.every_steps, "use 0 (off) or more")
        check(self.every_seconds >= 0, "every_seconds", self.every_seconds, "use 0 (off) or more")
        if self.interval == "seconds":
            check(
                self.every_seconds > 0,
                "every_seconds",
                self.every_seconds,
                'set it (> 0) with interval = "seconds"',
            )
        if self.interval == "auto":
            check(
                self.mtbf_s > 0,
                "mtbf_s",
                self.mtbf_s,
                'set the mean time between failures (seconds) with interval = "auto"',
            )
        check(self.mtbf_s >= 0, "mtbf_s", self.mtbf_s, "use 0 (unknown) or more")
        check(self.restart_s >= 0, "restart_s", self.restart_s, "use 0 or more seconds")
        check(
            self.keep_last >= 2,
            "keep_last",
            self.keep_last,
            "keep at least 2: restore falls back to the previous checkpoint when the newest "
            "one turns out damaged",
        )
        check(self.keep_every >= 0, "keep_every", self.keep_every, "use 0 (off) or a step count")
        check(
            self.lease_timeout_s > 0,
            "lease_timeout_s",
            self.lease_timeout_s,
            "use > 0 seconds (the writer lease's heartbeat runs every tenth of it)",
        )
        check(
            isinstance(self.storage_options, dict),
            "storage_options",
            self.storage_options,
            "give a table (dict) of fsspec options, e.g. {endpoint_url = ...}",
        )
