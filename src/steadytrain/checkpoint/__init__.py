"""Sharded asynchronous checkpoints with a two-phase commit and automatic resume."""

from steadytrain.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
