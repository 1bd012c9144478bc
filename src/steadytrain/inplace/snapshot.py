"""The in-memory snapshots of ``Recovery``: copied beside the step, never restored torn.

A snapshot is taken at the start of a step (the state the previous ``optimizer.step()``
left). Copying a model and its optimizer synchronously blocks the loop for the whole copy
(``bench/inplace_snapshot_cost.py``: ~0.28 s per 604 MB here), every ``every_steps``. But
most of those bytes cannot change until this step's ``optimizer.step()``: the parameters
of an optimizer and that optimizer's own state (moments, step counts). Those tensors are
copied by a background thread (``Copy``) while the step's forward and backward run; each
replicated optimizer's step pre-hook waits for the copy first, so the loop waits only for
what the forward and backward did not hide. Everything else is copied at once, in the loop:
a tensor that is no parameter of a replicated optimizer (a module's buffers, which the
forward may change: BatchNorm statistics, DDP's buffer broadcast), plain values, the
per-rank states.

``Copy`` is a double buffer's writing half: its tensors are the evicted snapshot's (a
steady run allocates nothing), and it becomes a snapshot ``Recovery`` may restore only once
the thread finished without an error (``Copy.wait``). Until then the older complete one is
the rollback point; a copy that failed is dropped, never restored.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Copy", "copy_state", "deferrable", "live_view"]

log = logging.getLogger("steadytrain.inplace")


def _dest(src: torch.Tensor, reuse: Any, live: set[int] | None) -> torch.Tensor:
    """Where ``src`` is copied: ``reuse`` where it fits, but never a tensor of the live
    state (``live``: the data pointers a ``live_view`` holds as they are, and ``src``)."""
    if (
        isinstance(reuse, torch.Tensor)
        and not (live is not None and reuse.data_ptr() in live)
        and reuse.data_ptr() != src.data_ptr()
        and reuse.shape == src.shape
        and reuse.dtype == src.dtype
        and reuse.device == src.device
    ):
        return reuse
    return torch.empty_like(src)


def _walk(
    src: Any,
    reuse: Any,
    later: list[tuple[torch.Tensor, torch.Tensor]] | None,
    defer: set[int],
    alias: bool = False,
) -> Any:
    """The copy of tree ``src`` (see ``copy_state``); with ``later``, a tensor whose
    ``data_ptr`` is in ``defer`` gets its destination now and its copy listed in ``later``;
    with ``alias``, such a tensor is not copied at all: the tree holds it (``live_view``)."""
    if isinstance(src, torch.Tensor):
        src = src.detach()
        deferred = type(src) is torch.Tensor and src.data_ptr() in defer
        if alias and deferred:
            return src
        dst = _dest(src, reuse, defer if alias else None)
        if later is not None and deferred:
            later.append((dst, src))
            return dst
        return dst.copy_(src)
    if isinstance(src, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _walk(v, old.get(k), later, defer, alias) for k, v in src.items()}
    if type(src) in (list, tuple):
        old = reuse if type(reuse) is type(src) and len(reuse) == len(src) else [None] * len(src)
        return type(src)(_walk(v, o, later, defer, alias) for v, o in zip(src, old, strict=True))
    return copy.deepcopy(src)


def copy_state(src: Any, reuse: Any = None) -> Any:
    """A deep copy of the state tree ``src``, its tensors copied into ``reuse``'s where that
    tree (an evicted snapshot) has a tensor of the same shape, dtype and device at the same
    place: a steady run allocates nothing per snapshot. (Fresh memory costs its first-touch
    page faults, ~6x the copy itself on this machine; NOTES-environment's copy floor.)"""
    return _walk(src, reuse, None, set())


def live_view(states: Any, reuse: Any, defer: set[int]) -> Any:
    """The state tree ``states`` as it stands now, without copying what only the
    optimizers' ``step()`` changes (``defer``: those tensors are held as they are, live);
    the rest is copied (into ``reuse``'s tensors where they fit, never into a live one).
    Valid until one of those optimizers steps (live.py)."""
    return _walk(states, reuse, None, defer, alias=True)


def deferrable(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """The ``data_ptr`` of every tensor only ``optimizers``' ``step()`` changes: their
    parameters and their per-parameter state."""
    out: set[int] = set()
    for opt in optimizers:
        tensors = [p for group in opt.param_groups for p in group["params"]]
        tensors += [t for state in opt.state.values() for t in state.values()]
        # Plain tensors only: a subclass (FSDP2's DTensor) may have no data pointer of its
        # own; it is copied at the start of the step, as everything was before.
        out.update(t.data_ptr() for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter))
    return out


class Copy:
    """One snapshot being written: ``tree`` (the states, its deferred tensors not yet
    filled) and the background thread that fills them. ``wait()`` joins it: True when the
    snapshot is complete, False when the copy failed (then it must never be restored)."""

    def __init__(
        self, step: int, tree: Any, own: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.step, self.tree, self.own = step, tree, own
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if pairs:
            self._thread = threading.Thread(
                target=self._run, args=(pairs,), name="steadytrain-snapshot", daemon=True
            )
            self._thread.start()

    @classmethod
    def start(
        cls, step: int, states: dict[str, Any], reuse: Any, own: Any, defer: set[int]
    ) -> Copy:
        """Copy ``states`` (name -> state_dict) into ``reuse``'s tensors: what is not in
        ``defer`` now, the rest in the background."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        tree = {k: _walk(v, (reuse or {}).get(k), pairs, defer) for k, v in states.items()}
        return cls(step, tree, own, pairs)

    def _run(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:  # one call (plain tensors only, deferrable()): torch releases the GIL for it all
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        except BaseException as e:  # noqa: BLE001 - reported by wait(), never restored
            self.error = e

    def wait(self) -> bool:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            log.warning(
                "in-place recovery: the snapshot of step %d failed to copy (%s: %s); it is "
                "dropped, and a rollback uses the one before it",
                self.step,
                type(self.error).__name__,
                self.error,
            )
            return False
        return True
