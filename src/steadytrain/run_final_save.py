"""What a failed final save means for the job's end: a crash when a rank is gone.

A save that fails mid-run is an event and training goes on: if a peer died, the next
collective of the step (DDP's all-reduce) fails at once and the job restarts. The final
save has no next collective. Its failure was the only sign of a dead peer, and a process
that then exited 0 left its torchrun agent waiting in the exit barrier for the dead node
(300 s), its spare unused, and the last steps on no durable storage (issue 43: a trainer's
fast tiny steps put a node's loss inside the final save). So a failed final save asks the
checkpoint group whether every rank is still there: when not, it is a crash
(``CheckpointError``; ``Run`` records it and raises), the agent restarts the job, and the
restart restores (from a peer's memory, or durable storage) and saves again. When the group
answers, the failure was the storage's: the save's event and alert said so, and the job ends
as before (a guard that is unsure lets the job be).
"""

from __future__ import annotations

from typing import Any

from steadytrain.errors import CheckpointError

__all__ = ["final_save_failed"]


def final_save_failed(ckpt: Any, step: int) -> None:
    """Raise ``CheckpointError`` if the final save of ``step`` failed and the checkpoint
    group is broken (a rank is gone); else return. Call it on every rank."""
    event = getattr(ckpt, "last_event", None) or {}
    group = getattr(ckpt, "group", None)
    if event.get("step") != step or event.get("ok", True) or group is None:
        return
    try:
        group.all_gather(None)  # every rank asks: a peer that is gone fails it at once
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the group is gone
        raise CheckpointError(
            f"the final save of step {step} failed ({event.get('error')}) and a rank of the "
            f"job is gone ({type(exc).__name__}: {exc}); exiting as a crash so the launcher "
            "restarts the job, which restores and saves the last step again"
        ) from exc
