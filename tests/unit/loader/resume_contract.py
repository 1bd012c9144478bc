"""The one resume contract every stateful stream piece must pass (STYLE.md #7).

Save at step ``k`` (at the start, mid-epoch, at an epoch boundary...) on one rank, restore on
world sizes 1, 2, 4 and with 0 or 2 workers, and compare the exact stream of global batches
with an uninterrupted single-process run. A piece plugs in with two callables:

* ``make(world_size, rank, num_workers)`` -> object with ``state_dict()``,
  ``load_state_dict(sd)`` and ``close()``;
* ``read_step(obj)`` -> ``{name: array}``: this rank's share of one step, rows first.

Ranks' shares are concatenated in rank order, which must reproduce the global batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

Make = Callable[[int, int, int], Any]
ReadStep = Callable[[Any], dict[str, np.ndarray]]

# (world_size, num_workers) combinations restored from every saved state.
DEFAULT_COMBOS = ((1, 0), (2, 0), (4, 0), (1, 2))


def uninterrupted(make: Make, read_step: ReadStep, steps: int) -> list[dict[str, np.ndarray]]:
    obj = make(1, 0, 0)
    try:
        return [read_step(obj) for _ in range(steps)]
    finally:
        obj.close()


def save_at(make: Make, read_step: ReadStep, k: int, world_size: int = 1, rank: int = 0) -> dict:
    obj = make(world_size, rank, 0)
    try:
        for _ in range(k):
            read_step(obj)
        state = obj.state_dict()
    finally:
        obj.close()
    text = json.dumps(state)  # must be JSON-serialisable as it is
    return json.loads(text)


def restored_stream(
    make: Make, read_step: ReadStep, state: dict, world_size: int, num_workers: int, steps: int
) -> list[dict[str, np.ndarray]]:
    objs = [make(world_size, r, num_workers) for r in range(world_size)]
    try:
        for obj in objs:
            obj.load_state_dict(state)
        out = []
        for _ in range(steps):
            parts = [read_step(obj) for obj in objs]
            out.append({key: np.concatenate([p[key] for p in parts]) for key in parts[0]})
        return out
    finally:
        for obj in objs:
            obj.close()


def check_resume_contract(
    make: Make,
    read_step: ReadStep,
    *,
    total_steps: int,
    ks: Iterable[int],
    combos: Sequence[tuple[int, int]] = DEFAULT_COMBOS,
    worker_ks: Iterable[int] | None = None,
    save_ranks: Sequence[tuple[int, int]] = ((1, 0), (2, 1)),
) -> None:
    """Assert that resuming at each ``k`` reproduces the uninterrupted stream exactly.

    Combos with workers are restored only at ``worker_ks`` (default: every ``k``) because
    spawning processes is the slow part; states are saved on each ``(world_size, rank)`` of
    ``save_ranks`` and must load anywhere.
    """
    reference = uninterrupted(make, read_step, total_steps)
    ks = list(ks)
    worker_ks = ks if worker_ks is None else list(worker_ks)
    for k in ks:
        for save_world, save_rank in save_ranks:
            state = save_at(make, read_step, k, save_world, save_rank)
            for world_size, workers in combos:
                if workers and (k not in worker_ks or (save_world, save_rank) != save_ranks[0]):
                    continue
                got = restored_stream(make, read_step, state, world_size, workers, total_steps - k)
                for i, (want, have) in enumerate(zip(reference[k:], got, strict=True)):
                    for key in want:
                        assert np.array_equal(want[key], have[key]), (
                            f"{key} differs at step {k + i} after saving at step {k} on rank "
                            f"{save_rank}/{save_world} and restoring on world_size={world_size}, "
                            f"num_workers={workers}"
                        )
