"""The classic baseline: one ``torch.save`` file written synchronously by rank 0 (nanoGPT).

``checkpoint.engine = "torch_save"`` swaps the Checkpointer for this, for benchmarks that
compare what asynchronous sharded checkpoints buy. Same calls (``restore_latest``,
``maybe_save``, ``save``, ``wait``, ``close``, ``last_event``) and the same ledger events, so
the goodput ledger measures both the same way. Every rank blocks until rank 0 has written
and fsync'd ``DIR/ckpt.pt`` (published atomically by ``storage.publish``, so a crash
mid-save keeps the previous one). DDP only: model and optimizer state are full on every rank; the loader state is
rank-independent; RNG state is not saved (the reference model has no dropout by default).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.storage.publish import atomic_writer

__all__ = ["TorchSaveCheckpointer"]


class TorchSaveCheckpointer:
    def __init__(
        self,
        directory: str,
        every_steps: int | None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        self.directory = directory
        self.every_steps = every_steps
        self.on_event = on_event
        self.last_event: dict[str, Any] | None = None
        self.path = os.path.join(directory, "ckpt.pt")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(directory, exist_ok=True)

    def _emit(self, event: dict[str, Any]) -> None:
        self.last_event = event
        if self.on_event is not None:
            self.on_event(event)

    def restore_latest(self, states: dict[str, Any]) -> int:
        t0 = time.perf_counter()
        if not os.path.exists(self.path):
            return 0
        saved = torch.load(self.path, map_location="cpu", weights_only=False)
        for name, obj in states.items():
            obj.load_state_dict(saved["states"][name])
        step = int(saved["step"])
        self._emit(
            {
                "type": "restore",
                "step": step,
                "restore_s": time.perf_counter() - t0,
                "path": self.path,
                "skipped": [],
            }
        )
        return step

    def maybe_save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        if not self.every_steps or step % self.every_steps:
            return 0.0
        return self.save(step, states, tokens_seen)

    def save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        t0 = time.perf_counter()
        if self.rank == 0:
            payload = {
                "step": step,
                "tokens_seen": tokens_seen,
                "states": {name: obj.state_dict() for name, obj in states.items()},
            }
            with atomic_writer(self.path) as f:
                torch.save(payload, f)
        if dist.is_initialized():
            dist.barrier()  # nobody goes on before the file is durable
        block_s = time.perf_counter() - t0
        self._emit(
            {
                "type": "checkpoint",
                "step": step,
                "block_s": block_s,
                "durable_s": block_s,
                "ok": True,
                "path": self.path,
                "error": None,
            }
        )
        return block_s

    def wait(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
