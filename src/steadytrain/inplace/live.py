"""The live recovery point of ``Recovery``: the state at the start of the step being run,
held by the survivors' own live objects instead of a copy.

With DDP a lost peer surfaces as an error of a collective of the forward or the backward
(the gradient all-reduce), before that step's ``optimizer.step()``. Until then the
parameters of the replicated optimizers and their state (moments, step counts) are still
what the previous step left, the same on every rank: a survivor that did not step its
optimizers in the failed step holds the start of that step live, and nothing of it needs a
copy. What a step may change before ``optimizer.step()`` is small and is copied at the
start of each step (``Live``): each per-rank state (the loader, the generators) and, of the
replicated states, everything that is not an optimizer's tensor (a module's buffers, which
the forward changes; plain values such as the optimizer's ``param_groups``).

``Slots``: each rank's per-rank states also go to torchrun's store, where a replaced rank
reads its own back (a few KB; ``torch.save``, read back with ``weights_only=True``, since
anyone on the job's network can write to that store). Each kind of recovery point has two
slots per rank, overwritten in turn, so the store holds a bounded set of keys however long
the run: a rank may die between its peers' start of a step and its own (or one step ahead
of a peer still finishing the previous step's collective), hence two.
"""

from __future__ import annotations

import dataclasses
import io
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.inplace.snapshot import live_view

__all__ = ["RNG", "SLOTS", "Live", "Slots", "rng_state", "set_rng_state", "take"]

SLOTS = 2  # per kind and rank: the newest two recovery points
RNG = "__steadytrain_rng__"  # the generators' entry among a rank's per-rank states


def rng_state() -> tuple[torch.Tensor, tuple[int, torch.Tensor, float | None]]:
    """torch's and ``random``'s generators; ``random``'s 625 words as one tensor, which the
    store's ``torch.save`` writes in one piece (as a tuple of ints it cost ~0.2 ms more a
    step)."""
    version, words, gauss = random.getstate()
    return torch.get_rng_state(), (version, torch.tensor(words, dtype=torch.int64), gauss)


def set_rng_state(state: tuple[torch.Tensor, tuple[int, torch.Tensor, float | None]]) -> None:
    torch_rng, (version, words, gauss) = state
    torch.set_rng_state(torch_rng)
    random.setstate((version, tuple(int(w) for w in words.tolist()), gauss))


@dataclasses.dataclass(frozen=True)
class Live:
    """The start of step ``step`` on this rank: ``tree`` the replicated states (the
    optimizers' tensors aliased, the rest copied), ``own`` the per-rank states (copies)."""

    step: int
    tree: dict[str, Any]
    own: dict[str, Any]


def take(
    step: int, states: dict[str, Any], own: dict[str, Any], defer: set[int], prev: Live | None
) -> Live:
    """The live recovery point of ``step``; its copies reuse ``prev``'s tensors (a steady
    run allocates nothing for them)."""
    return Live(step, live_view(states, prev.tree if prev else None, defer), own)


def _dumps(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _loads(data: bytes) -> dict[str, Any]:
    """A per-rank state back from the store: tensors and plain values only (a state that
    needs more fails here, and the regroup falls back to the whole restart)."""
    return torch.load(io.BytesIO(data), weights_only=True)


class Slots:
    """This rank's per-rank states in torchrun's store, under ``prefix``: kind ``live`` (the
    start of every step) and ``snap`` (each in-memory snapshot), ``SLOTS`` keys each."""

    def __init__(self, store: Callable[[], dist.Store], prefix: str) -> None:
        self._store, self._prefix = store, prefix

    def key(self, kind: str, slot: int) -> str:
        return f"{self._prefix}/{kind}{slot % SLOTS}"

    def put(self, kind: str, slot: int, step: int, own: dict[str, Any]) -> None:
        self._store().set(self.key(kind, slot), _dumps({"step": step, "own": own}))

    def read(self, kind: str) -> dict[int, dict[str, Any]]:
        """step -> per-rank states, of the slots of ``kind`` that exist (a rank that died
        before writing any has none, and the agreement falls back)."""
        store, found = self._store(), {}
        for slot in range(SLOTS):
            key = self.key(kind, slot)
            if store.check([key]):
                got = _loads(store.get(key))
                found[int(got["step"])] = got["own"]
        return found
