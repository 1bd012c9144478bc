"""Snapshot a state dict into CPU buffers that are allocated once and reused.

The training loop is blocked only while this copy runs. A fresh ``clone()`` pays a page fault
per 4 KiB page on first touch (~2 GB/s here); copying into memory that was touched by the
previous save runs at memcpy speed (~13 GB/s), which is what makes frequent checkpoints
nearly free. Buffers are keyed by their path in the state dict and reallocated only when a
shape or dtype changes. For the ``process`` mode they live in shared memory so handing them
to the writer process sends a file descriptor, not the bytes.

With CUDA, the buffers are pinned (page-locked) by default: a device-to-host copy into
pageable memory goes through the driver's bounce buffer at a fraction of the link's speed,
one into pinned memory is a DMA at full speed and can be asynchronous, so every tensor's copy
is queued at once and ``stage()`` waits once at the end. Pinning is slow to allocate (it
maps and locks pages), which is one more reason the buffers are kept across saves. The
shared-memory buffers of the ``process`` mode are not pinned (that would need registering
the shared segment with CUDA): that mode stages through pageable memory.

The snapshot is consistent: every tensor is copied before ``stage()`` returns, so a later
optimizer step cannot leak into what is written.

``layout_version`` changes whenever a snapshot's layout differs from the previous one's (a
key added or gone, a value that changed kind, a buffer reallocated for a new shape or
dtype): the writer reuses the previous save's plan only while it stays put
(``repeat_save.py``). Comparing the walk's keys costs microseconds on the blocking path.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

__all__ = ["Stager"]


_NUMPY_OK = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


class Stager:
    """Copies tensors of a nested state dict into reusable CPU buffers.

    ``pin_memory``: None (default) pins when CUDA is available and the buffers are not in
    shared memory; True insists (an error without CUDA); False never pins.
    """

    def __init__(self, shared_memory: bool = False, pin_memory: bool | None = None) -> None:
        if pin_memory is None:
            pin_memory = not shared_memory and torch.cuda.is_available()
        elif pin_memory and shared_memory:
            raise ValueError(
                "Stager(pin_memory=True, shared_memory=True): shared-memory buffers (the "
                "'process' async mode) are not pinned; use async_mode='thread' for pinned staging"
            )
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "Stager(pin_memory=True) needs CUDA, and torch.cuda.is_available() is False; "
                "leave pin_memory unset to pin only where CUDA is present"
            )
        self.shared_memory = shared_memory
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._in_flight: set[torch.device] = set()  # devices with queued async copies
        self.bytes_staged = 0
        self.allocations = 0  # buffers allocated so far: stays put once shapes settle
        self.layout_version = 0  # +1 whenever a snapshot's layout differs from the last one's
        self._layout: list[tuple] = []  # (key, kind) of every leaf of the last snapshot
        self._walked: list[tuple] = []

    def _buffer(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin_memory)
            self.allocations += 1
            if self.shared_memory:
                buf.share_memory_()
            self._buffers[key] = buf
        return buf

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            local = self._copy(key + ("<local>",), t.to_local())
            return DTensor.from_local(
                local,
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        buf = self._buffer(key, src)
        if src.device.type == "cpu" and src.dtype in _NUMPY_OK and src.numel():
            # numpy's copy is one memcpy on this thread; torch's copy_ wakes its OpenMP pool,
            # which on a busy host costs milliseconds per small tensor.
            np.copyto(buf.numpy(), src.numpy())
        elif self.pin_memory and src.device.type == "cuda":
            # Queued on the source device's current stream; stage() waits for all of them.
            buf.copy_(src, non_blocking=True)
            self._in_flight.add(src.device)
        else:
            buf.copy_(src)
        self.bytes_staged += buf.numel() * buf.element_size()
        return buf

    def stage(self, state: Any, wait: bool = True) -> Any:
        """Return a deep snapshot of ``state`` with every tensor copied to a CPU buffer.

        ``wait=False`` (CUDA): return once the device-to-host copies are queued; the caller
        owns the ordering (``in_flight_devices()``): it records an event on the stream the
        copies were queued on, makes the training stream wait for it before anything can
        overwrite the sources, and waits for the event before reading the buffers (the
        memory tier: ``memory/tier.py``)."""
        self.bytes_staged = 0
        self._walked = []
        allocations = self.allocations
        try:
            staged = self._walk((), state)
        finally:
            # The snapshot must be complete when stage() returns: the caller's next optimizer
            # step may overwrite the sources as soon as it does.
            if wait:
                for device in self._in_flight:
                    torch.cuda.current_stream(device).synchronize()
                self._in_flight.clear()
        if self._walked != self._layout or self.allocations != allocations:
            self.layout_version += 1
            self._layout = self._walked
        return staged

    def in_flight_devices(self) -> list[torch.device]:
        """The devices with copies queued by ``stage(wait=False)``, now forgotten here."""
        devices, self._in_flight = sorted(self._in_flight, key=str), set()
        return devices

    def _walk(self, key: tuple, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # a plain tensor, or a subclass (DTensor) whose placement is part of the layout
            self._walked.append((key, type(obj)))
            return self._copy(key, obj)
        if isinstance(obj, dict):
            return {k: self._walk(key + (k,), v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(key + (i,), v) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(key + (i,), v) for i, v in enumerate(obj))
        self._walked.append((key, type(obj)))
        return copy.deepcopy(obj)

    def release(self) -> None:
        """Drop all buffers (the next ``stage`` allocates again)."""
        self._buffers.clear()
        self._layout = []
