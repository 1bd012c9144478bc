"""The floor of any checkpoint writer on this host, for ``bench/interference.py``.

A checkpoint's bytes must go through the page cache to the disk whatever writes them. On a
2-core VM that alone slows the training thread (memory bandwidth, the shared L3, the
kernel's write-back and interrupts), with no GIL involved. ``FloorWriter`` measures that
part: it writes the same tensors' raw bytes with one ``os.write`` per tensor (the GIL is
released for the copy into the page cache) from a background thread, then fsyncs, and
nothing else: no serialization, no hashing, no metadata, no commit. It runs at the pace of
the real writer (``period_s``: a new save starts no sooner than that after the previous one
started), so it moves the same bytes per second; a contender's slowdown above this floor's
is what the writer itself adds.

It speaks the part of ``Checkpointer``'s interface the benchmark uses (``save``,
``maybe_save``, ``wait``, ``close`` and ``checkpoint`` events).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def _tensors(states: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor the checkpoint of ``states`` holds (module and optimizer state dicts)."""
    out: list[torch.Tensor] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    for obj in states.values():
        walk(obj.state_dict())
    return out


class FloorWriter:
    def __init__(self, directory: str, period_s: float, on_event: Callable[[dict], None]):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "floor.bin")
        self.period_s, self.on_event = period_s, on_event
        self._staged: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self.nbytes = 0

    def save(self, step: int, states: dict[str, Any]) -> None:
        """Stage a copy (the blocking part, as the real writer's), write it in the background."""
        self.wait()
        src = _tensors(states)
        if [t.shape for t in self._staged] != [t.shape for t in src]:
            self._staged = [torch.empty_like(t, device="cpu") for t in src]
        for dst, t in zip(self._staged, src, strict=True):
            dst.copy_(t.detach())
        self.nbytes = sum(t.numel() * t.element_size() for t in self._staged)
        self._thread = threading.Thread(target=self._write, args=(step,), daemon=True)
        self._thread.start()

    def _write(self, step: int) -> None:
        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in self._staged:
                view = memoryview(t.numpy()).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        durable_s = time.perf_counter() - t0
        # Keep the real writer's pace: the same bytes per second, not more.
        time.sleep(max(0.0, self.period_s - durable_s))
        self.on_event({"type": "checkpoint", "ok": True, "step": step, "durable_s": durable_s})

    def maybe_save(self, step: int, states: dict[str, Any]) -> None:
        """Never due (the benchmark starts saves itself); events are delivered by ``_write``."""

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.wait()
        if os.path.exists(self.path):
            os.remove(self.path)
