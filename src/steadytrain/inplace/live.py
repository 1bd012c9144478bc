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

``Ahead``: a rank's state of step s + 1 is already published at its optimizer's step
pre-hook of step s, so a rank lost in its ``optimizer.step()`` or the loop's tail (its peers
then live at s + 1) can still be resumed live; every rank checks at the start of s + 1 that
the publication was its true state.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.inplace.snapshot import live_view

__all__ = [
    "RNG",
    "SLOTS",
    "Ahead",
    "Live",
    "Slots",
    "own_state",
    "rng_state",
    "set_rng_state",
    "take",
]

log = logging.getLogger("steadytrain.inplace")

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


def own_state(per_rank: dict[str, Any]) -> dict[str, Any]:
    """Copies of this rank's per-rank states, and its generators' (``RNG``), now."""
    own = {k: copy.deepcopy(v.state_dict()) for k, v in per_rank.items()}
    own[RNG] = rng_state()
    return own


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
    start of every step) and ``snap`` (each in-memory snapshot), ``SLOTS`` keys each. A
    record is ``ahead`` when the optimizer's step pre-hook published it for the next step
    (``Ahead``), before the loop reached that step."""

    def __init__(self, store: Callable[[], dist.Store], prefix: str) -> None:
        self._store, self._prefix = store, prefix

    def key(self, kind: str, slot: int) -> str:
        return f"{self._prefix}/{kind}{slot % SLOTS}"

    @staticmethod
    def record(step: int, own: dict[str, Any], ahead: bool = False) -> bytes:
        return _dumps({"step": step, "own": own, "ahead": ahead})

    def put(self, kind: str, slot: int, step: int, own: dict[str, Any]) -> None:
        self.put_record(kind, slot, self.record(step, own))

    def put_record(self, kind: str, slot: int, data: bytes) -> None:
        self._store().set(self.key(kind, slot), data)

    def read(self, kind: str) -> tuple[dict[int, dict[str, Any]], tuple[int, ...]]:
        """step -> per-rank states, of the slots of ``kind`` that exist (a rank that died
        before writing any has none, and the agreement falls back), and the steps among them
        that the optimizer's pre-hook published (``Ahead``)."""
        store, found, ahead = self._store(), {}, []
        for slot in range(SLOTS):
            key = self.key(kind, slot)
            if store.check([key]):
                got = _loads(store.get(key))
                found[int(got["step"])] = got["own"]
                if got.get("ahead"):
                    ahead.append(int(got["step"]))
        return found, tuple(sorted(ahead))


class Ahead:
    """The per-rank state of the next step, published at the replicated optimizer's step
    pre-hook of step s (the gradient all-reduce is complete: if nothing else fails, every
    rank will be at s + 1). A rank that dies in its ``optimizer.step()`` or the loop's tail
    then leaves its state of the step its peers reach in the store, and the regroup can stay
    live.

    That is only right if the loop changes no per-rank state (loader, generators) between
    ``optimizer.step()`` and the next step's start, so every rank checks it at that start
    (``write``): the same bytes, nothing more to write; others, the true state is written
    and the pre-hook publication is void on this rank for good (``broken``), and the
    regroup's agreement takes a replaced rank's ``ahead`` state only from survivors that
    proved it (``proven``) at the very step they are live at."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._pending: tuple[int, bytes] | None = None  # (step, record) published ahead
        self.broken: int | None = None  # the first step whose true state differed
        self.checked: int | None = None  # the newest step whose publication was proven

    def publish(self, step: int, own: dict[str, Any]) -> None:
        """The pre-hook's publication of ``own`` as this rank's state of ``step``. A store
        that fails here only costs the publication (a warning): the step goes on."""
        if self.broken is not None:
            return
        data = Slots.record(step, own, ahead=True)
        try:
            self._slots.put_record("live", step, data)
        except Exception as e:  # noqa: BLE001 - a missed publication must not end the step
            log.warning("in-place recovery: could not publish step %d's state ahead: %s", step, e)
            return
        self._pending = (step, data)

    def write(self, step: int, own: dict[str, Any]) -> None:
        """At the start of ``step``: its true per-rank state to the store, unless the
        pre-hook already published exactly that."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            if pending[1] == Slots.record(step, own, ahead=True):
                self.checked = step
                return
            self.broken = step
            log.warning(
                "in-place recovery: a per-rank state changed after optimizer.step() of step "
                "%d (the loop fetches a batch or draws random numbers there?); a rank lost in "
                "its optimizer step or the loop's tail now falls back (snapshot or the whole "
                "restart)",
                step - 1,
            )
        self._slots.put("live", step, step, own)

    def proven(self, step: int | None) -> bool:
        """Whether this rank proved, at the start of ``step``, that the pre-hook published
        its true state, and never saw it differ."""
        return step is not None and self.broken is None and self.checked == step

    def reset(self) -> None:
        """A regroup restored the states: nothing published ahead stands."""
        self._pending = None
