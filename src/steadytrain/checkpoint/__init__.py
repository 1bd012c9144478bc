"""Sharded asynchronous checkpoints with a two-phase commit and automatic resume.

``Checkpointer`` is imported on first use: the read-only paths (``steadytrain
checkpoints``, ``checkpoint.inspect``, ``checkpoint.commit``) must not pay for importing
torch just because they live in this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from steadytrain.checkpoint.checkpointer import Checkpointer

        globals()["Checkpointer"] = Checkpointer
        return Checkpointer
    raise AttributeError(f"module 'steadytrain.checkpoint' has no attribute {name!r}")
