"""The memory tier: recovery points in node-local memory plus a copy on a peer's node.

``config`` (settings), ``snapshot`` (the file format), ``store`` (layout, retention,
budget), ``peers`` (pairing and transfers), ``tier`` (``MemoryTier``: scheduling, restore).
The ``Checkpointer`` drives it (``CheckpointerConfig(memory=MemoryConfig(every_steps=K))``).
"""

from steadytrain.checkpoint.memory.config import MemoryConfig

__all__ = ["MemoryConfig"]
