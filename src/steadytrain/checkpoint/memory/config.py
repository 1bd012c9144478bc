"""``MemoryConfig``: the memory tier's settings (``[checkpoint.memory]``), checked once.

Its own module so ``CheckpointerConfig`` composes it without importing the tier's machinery
(torch, gloo): the training config and ``steadytrain plan`` read it too.
"""

from __future__ import annotations

import dataclasses
import os

from steadytrain.checkpoint.memory.private import default_dir
from steadytrain.node import ENV_NODE  # a rank's node name (else the host name)
from steadytrain.settings import check

__all__ = ["MemoryConfig", "ENV_DIR", "ENV_NODE", "default_dir"]

ENV_DIR = "STEADYTRAIN_MEMORY_DIR"  # the node harness gives each node its own tmpfs


@dataclasses.dataclass(kw_only=True)
class MemoryConfig:
    """Recovery points in node-local memory plus a copy on a rank of another node."""

    # snapshot every K steps; 0: the memory tier is off; "auto": the planner's K from this
    # job's measured step time and snapshot cost and checkpoint.mtbf_s (memory/auto.py)
    every_steps: int | str = 0
    survives: float = 0.75  # "auto": the share of failures memory survives (crash, 1 node)
    # node-local memory directory; "": $STEADYTRAIN_MEMORY_DIR, else /dev/shm/steadytrain-<uid>
    # (never a shared file system: a node's snapshots must die with the node; private.py)
    dir: str = ""
    budget_bytes: int = 0  # 0: half the free space of `dir`'s file system at start
    peer: bool = True  # also keep a copy on a rank of another node

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, str) and self.every_steps.strip().isdigit():
            self.every_steps = int(self.every_steps)  # --set ...every_steps=2 arrives as text
        check(
            self.every_steps == "auto"
            or (isinstance(self.every_steps, int) and self.every_steps >= 0),
            "every_steps",
            self.every_steps,
            'use 0 (the memory tier off), a step count, or "auto" (with checkpoint.mtbf_s)',
        )
        check(
            0.0 < self.survives <= 1.0,
            "survives",
            self.survives,
            "give the share of failures memory survives, in (0, 1]",
        )
        check(
            isinstance(self.budget_bytes, int) and self.budget_bytes >= 0,
            "budget_bytes",
            self.budget_bytes,
            "use 0 (half the free space of the memory directory) or a byte count",
        )
        check(isinstance(self.dir, str), "dir", self.dir, "give a local directory path")
        check(
            "://" not in self.dir,
            "dir",
            self.dir,
            "give a node-local directory (a tmpfs such as /dev/shm), not a URL",
        )

    @property
    def enabled(self) -> bool:
        return self.every_steps == "auto" or self.every_steps > 0

    def resolved_dir(self) -> str:
        """The directory snapshots live in, after the environment and the default (the
        user's own, ``private.default_dir``)."""
        return self.dir or os.environ.get(ENV_DIR, "") or default_dir()
