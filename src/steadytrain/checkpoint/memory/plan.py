"""The restore plan of the memory tier: pure functions of what every rank reported.

``choose``: the newest step at or after the newest durable commit for which every owner's
copy is on some node, and where each owner gets it (itself when its node holds one, else
the lowest rank of a node that does). ``check_copy``: a loaded copy is this rank's and fits
its states, checked before anything is written. ``newest_durable_step``: the step to beat.
"""

from __future__ import annotations

import logging
from typing import Any

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.memory.store import short
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.checkpoint.restore import foreign_run
from steadytrain.errors import CheckpointError

__all__ = ["choose", "check_copy", "newest_durable_step"]

log = logging.getLogger("steadytrain.checkpoint")


def newest_durable_step(root: Root, nonce: str | None = None) -> int:
    """The newest committed durable step under ``root`` (0: none) that the durable restore
    would not pass over: of this run (``nonce``), or with no run nonce (restore.py). A
    listing that fails is logged and taken as 0: memory may still restore, and the durable
    path will say."""
    try:
        return max(
            (i.step for i in discover(root) if i.committed and not foreign_run(i.manifest, nonce)),
            default=0,
        )
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("listing durable checkpoints in %s failed: %s", root.url, exc)
        return 0


def choose(
    held: list[dict[int, dict[int, Any]]], world: int, durable_step: int
) -> tuple[int, dict[int, tuple[int, int]]] | None:
    """The agreed plan from every rank's holdings (``held[r][owner][step] = (nbytes,
    digest)``): the newest step >= ``durable_step`` complete for every owner, and each
    owner's source ``(rank, nbytes)``: itself when it holds a copy, else the lowest holder."""
    steps = sorted({s for h in held for st in h.values() for s in st}, reverse=True)
    for step in steps:
        if step < durable_step:
            break
        sources: dict[int, tuple[int, int]] = {}
        for owner in range(world):
            holders = [r for r, h in enumerate(held) if step in h.get(owner, {})]
            if not holders:
                break
            src = owner if owner in holders else holders[0]
            sources[owner] = (src, int(held[src][owner][step][0]))
        else:
            return step, sources
    return None


def check_copy(
    header: dict[str, Any],
    tree: Any,
    states: dict[str, Any],
    job: str,
    world: int,
    rank: int,
    step: int,
    nonce: str | None = None,
) -> None:
    """Refuse, before anything is written, a copy that is not this run's and rank's or does
    not fit."""
    if header.get("run_nonce") != nonce:
        raise CheckpointError(
            f"the snapshot was written by another run (nonce {short(header.get('run_nonce'))}, "
            f"this run's is {short(nonce)})"
        )
    if (header.get("job"), header.get("world_size"), header.get("owner"), header.get("step")) != (
        job,
        world,
        rank,
        step,
    ):
        raise CheckpointError(
            f"the snapshot holds job {header.get('job')!r} rank {header.get('owner')} of "
            f"{header.get('world_size')} at step {header.get('step')}, not rank {rank} at {step}"
        )
    if not isinstance(header.get("json_states"), dict) or not isinstance(header.get("rng"), dict):
        raise CheckpointError("the snapshot has no json_states / rng objects")
    S.check_rng_state(header["rng"])
    S.check_json_states(states, header["json_states"])
    modules, _, _ = S.split_states(states)
    template = S.dcp_state_dict({n: m for n, m in modules.items()})
    for name, live in template.items():
        saved = tree.get(name) if isinstance(tree, dict) else None
        if not isinstance(saved, dict) or set(saved) != set(live):
            raise CheckpointError(f"state {name!r}: the snapshot's keys differ from the model's")
        for key, t in live.items():
            s = saved[key]
            if hasattr(t, "shape") and (getattr(s, "shape", None) != t.shape or s.dtype != t.dtype):
                raise CheckpointError(
                    f"state {name!r}.{key}: snapshot {getattr(s, 'shape', None)} "
                    f"{getattr(s, 'dtype', None)}, model {tuple(t.shape)} {t.dtype}"
                )
