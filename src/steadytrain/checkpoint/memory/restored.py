"""What a memory restore does with the copies it got: the pieces ``tier.MemoryTier.restore``
uses around the plan and the transfers.

``parse_copy``: a copy verified and decoded, a damaged one a ``Damaged`` (that copy is
dropped, not the step). ``owned``: the states an optimizer may keep, copied out of a mapped
file the tier rewrites later. ``give_back``: a received copy's pages no kept tensor lies on
returned to the system. ``Background``: the durable listing, run while the copies move.
``bounded``: what the restore passed over, at most ``PASSED_MAX`` entries.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterator
from typing import Any

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.memory import snapshot as snap
from steadytrain.errors import CheckpointError

__all__ = [
    "PASSED_MAX",
    "Background",
    "Damaged",
    "bounded",
    "give_back",
    "own_copy",
    "owned",
    "parse_copy",
    "tensors_of",
]

PASSED_MAX = 64  # entries of a restore's ``skipped`` from memory; the rest are counted


def bounded(passed: list[dict[str, Any]], root: str) -> list[dict[str, Any]]:
    """At most ``PASSED_MAX`` entries (a job of thousands of ranks may pass over as many
    copies, and a ledger line is bounded), the rest counted in the last one."""
    if len(passed) <= PASSED_MAX:
        return passed
    kept, rest = passed[: PASSED_MAX - 1], passed[PASSED_MAX - 1 :]
    nodes = sorted({str(p.get("node", "?")) for p in rest})
    more = {
        "path": root,
        "step": 0,
        "reason": f"{len(rest)} more copies passed over, on {', '.join(nodes[:8])}"
        + (f" and {len(nodes) - 8} more nodes" if len(nodes) > 8 else ""),
    }
    return kept + [more]


class Damaged(CheckpointError):
    """A copy that fails its checksum or does not decode: that copy is dropped, not the
    step."""


def parse_copy(buf: Any, path: str, where: str) -> tuple[dict[str, Any], Any]:
    if buf is None:
        raise CheckpointError(f"{path} vanished before it was read")
    try:
        return snap.parse(buf, where)
    except CheckpointError as exc:
        raise Damaged(str(exc)) from None


class Background:
    """``fn()`` on a thread of its own (None: nothing to do); ``result()`` waits for it."""

    def __init__(self, fn: Callable[[], int] | None) -> None:
        self._value: int | None = None
        self._thread = None
        if fn is not None:
            self._thread = threading.Thread(
                target=lambda: setattr(self, "_value", fn()),
                name="steadytrain-memory-durable-listing",
                daemon=True,
            )
            self._thread.start()

    def result(self) -> int | None:
        if self._thread is not None:
            self._thread.join()
        return self._value


def give_back(buf: Any, kept: Any) -> None:
    """Release the pages of ``buf`` (an anonymous mapping, ``snap.anonymous``) that no
    tensor of ``kept`` lies on: they read as zeros afterwards and cost no memory."""
    view = getattr(buf, "base", None)
    mapping = view.obj if isinstance(view, memoryview) else view
    if not isinstance(mapping, mmap.mmap) or len(mapping) != len(buf) or not len(buf):
        return  # not a whole mapping of its own: nothing to give back
    base, page = buf.ctypes.data, mmap.PAGESIZE
    spans = sorted(
        (t.data_ptr() - base, t.data_ptr() - base + t.nbytes) for t in tensors_of(kept) if t.nbytes
    )
    start = 0
    for lo, hi in [*spans, (len(buf), len(buf))]:
        a, b = -(-start // page) * page, min(lo, len(buf)) // page * page
        if b > a:
            mapping.madvise(mmap.MADV_DONTNEED, a, b - a)
        start = max(start, hi)


def tensors_of(obj: Any) -> Iterator[Any]:
    """Every tensor in a nest of dicts, lists and tuples (the shapes a state dict takes)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)
    elif hasattr(obj, "to_local"):  # a DTensor: its local part is what lies in the buffer
        yield obj.to_local()
    elif hasattr(obj, "data_ptr") and hasattr(obj, "nbytes"):
        yield obj


def owned(tree: dict[str, Any], states: dict[str, Any]) -> dict[str, Any]:
    """``tree`` as it is loaded from this node's own file. Modules copy into their
    parameters; anything else (an optimizer) may keep the tensors it is given, so those get
    their own copies: the tier rewrites that file later, and a private mapping sees what is
    written. (A copy received from a peer is this restore's memory alone: its tensors are
    kept as they are, and the pages no kept tensor lies on are given back.) Done before the
    ranks agree, as it writes no live state: a rank that loads its own copy has the time
    while the ranks that receive theirs finish."""
    modules, _, _ = S.split_states(states)
    return {k: v if k in modules else own_copy(v) for k, v in tree.items()}


def own_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied out of the snapshot buffer."""
    if isinstance(obj, dict):
        return {k: own_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(own_copy(v) for v in obj)
    return obj.clone() if hasattr(obj, "clone") and hasattr(obj, "dtype") else obj
