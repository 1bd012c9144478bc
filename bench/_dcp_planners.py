"""DCP's own plan caching for the async peers of ``bench/checkpoint_block.py``.

``DefaultSavePlanner(enable_plan_caching=True)`` keeps the local plan, the global plan and
the metadata after the first save and reuses them while the state's structure is unchanged:
DCP's counterpart of our repeat saves. DCP keys that cache by the planner's class name, so
each async executor gets a class of its own (the thread and process contenders never share
or mask each other's cache). The classes live in a module, not in the benchmark script, so
the process executor's daemon can unpickle them.
"""

from __future__ import annotations

from torch.distributed.checkpoint import DefaultSavePlanner


class ThreadCachingPlanner(DefaultSavePlanner):
    """The planner of the DCP async thread contender."""


class ProcessCachingPlanner(DefaultSavePlanner):
    """The planner of the DCP async process contender."""
