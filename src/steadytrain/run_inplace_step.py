"""``with run.recoverable(step)`` and the ledger side of an in-place recovery (issue 44).

A survivor that loses a peer inside the block, in this order:

1. notes the fault in torchrun's store (the step it reached, when it failed, the detection
   time: the last progress to the failing collective), so a replaced rank 0 can write the
   record too;
2. closes its attempt in the ledger (``job_end`` reason ``inplace: ...``): the time from
   here to the next attempt's first step is a restart gap, not productive time, and the
   rolled-back steps are redone work, both booked by the goodput accounting as any restart;
3. regroups, rolls back and rebuilds (``Recovery``; under the watchdog's checkpoint phase,
   so a regroup is never reaped as a hang);
4. opens the next attempt (a new meter, ``job_start`` with the regroup as its start-up and
   the rollback as its restore) and, once the redone steps are done again, rank 0 writes the
   ``inplace_recovery`` record with its phases (detection, regroup, restore, rebuild, redo).

A fallback (``InPlaceFallback`` here, or the keeper's verdict) is put in the store under the
attempt; the next attempt's rank 0 writes it as an ``inplace_recovery`` record with path
``whole_restart`` and the reason (``run_inplace.classify``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from steadytrain.inplace import regroup
from steadytrain.run_inplace import IN_PLACE, WHOLE_RESTART, InPlace, recovery_record

__all__ = ["InPlaceLedger", "RecoverableStep", "fallback_key", "note_fallback"]

log = logging.getLogger("steadytrain.inplace")

_PREFIX = "steadytrain/inplace"
IN_PLACE_TIER = "in-place"  # a restore record's tier: from the survivors' own memory


def fallback_key(attempt: str | int, rank: int) -> str:
    """Where the store holds why rank ``rank`` left torchrun attempt ``attempt`` to the
    whole restart (the keeper's verdict, or the survivor's ``InPlaceFallback``)."""
    return f"{_PREFIX}/{attempt}/fallback/r{rank}"


def note_fallback(
    store: Any,
    attempt: str | int,
    rank: int,
    why: str,
    step: int | None,
    keep_existing: bool = False,
) -> None:
    """Put a fallback's reason in the store for the next attempt's ledger (best effort: the
    store may be going down with the attempt, and the restart must not wait for it).
    ``keep_existing``: a reason already there stays (the keeper's verdict on an exit status
    is less precise than the reason its process left before it exited)."""
    try:
        key = fallback_key(attempt, rank)
        if keep_existing and store.check([key]):
            return
        store.set(key, json.dumps({"why": why, "step": step}))
    except Exception as e:  # noqa: BLE001 - a reason lost, never the restart
        log.warning("could not note the in-place fallback in the store: %s", e)


class InPlaceLedger:
    """The records of in-place recoveries for one process (every rank computes; rank 0's
    meter writes them)."""

    def __init__(self, inplace: InPlace) -> None:
        self.inplace, self.recovery = inplace, inplace.recovery
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._pending: dict[str, Any] | None = None  # waiting for its redo to finish
        self._redo_from = 0.0
        self._progress_t = time.time()
        self._next_ids: list[Any] | None = None  # rank 0 survivor: published at the fault

    def next_ids(self, rank: int) -> list[Any]:
        """After a survivor's regroup: the new attempt's ids (see ``share_ids``)."""
        if rank == 0 and self._next_ids is not None:
            return self._next_ids
        return list(
            json.loads(
                self._store().get(f"{_PREFIX}/{self.attempt}/ids/g{self.recovery.generation}")
            )
        )

    def _store(self) -> Any:
        return self.recovery._the_store()

    def share_ids(self, rank: int, ids: list[Any], generation: int | None = None) -> list[Any]:
        """Rank 0's (attempt id, attempt, nonce) for a generation (default: the current
        one), through the store: rank 0 publishes ``ids``, the others read them. Rank 0
        publishes before anything that waits for the other ranks (a survivor: before it
        regroups; a replacement: before the loop rebuilds its DDP), so no rank waits here
        for one that waits for it."""
        gen = self.recovery.generation if generation is None else generation
        key = f"{_PREFIX}/{self.attempt}/ids/g{gen}"
        if rank == 0:
            self._store().set(key, json.dumps(ids))
            return ids
        return list(json.loads(self._store().get(key)))

    def restore_s(self) -> float:
        return float((self.recovery.last_regroup or {}).get("phases", {}).get("restore_s", 0.0))

    # -- the fault, seen by a survivor ----------------------------------------------------
    def progress(self) -> None:
        self._progress_t = time.time()

    def fault(self, run: Any, step: int) -> dict[str, float]:
        t_fail = time.time()
        if run.rank == 0:  # the next attempt's ids, for the generation the regroup forms
            nxt = [t_fail, run.attempt + 1, run.nonce]
            self._next_ids = self.share_ids(0, nxt, self.recovery.generation + 1)
        note = {"from_step": step, "t_fail": t_fail, "detection_s": t_fail - self._progress_t}
        try:  # a replaced rank 0 reads it (run_inplace_step docstring)
            key = f"{_PREFIX}/{self.attempt}/fault/g{self.recovery.generation}"
            self._store().set(key, json.dumps(note))
        except Exception as e:  # noqa: BLE001 - the record loses its detection time, no more
            log.warning("could not note the fault in the store: %s", e)
        return note

    def _note_of(self, generation: int) -> dict[str, Any]:
        key = f"{_PREFIX}/{self.attempt}/fault/g{generation}"
        try:
            store = self._store()
            return json.loads(store.get(key)) if store.check([key]) else {}
        except Exception:  # noqa: BLE001 - a record without the survivor's view
            return {}

    # -- the next attempt ------------------------------------------------------------------
    def started(self, run: Any, replaced: bool) -> None:
        """At the start of a process's attempt: the previous torchrun attempt's fallbacks
        (rank 0), and for a replacement, its own recovery's record (pending its redo)."""
        if run.rank == 0 and int(self.attempt) > 0:
            for rank in range(run.world_size):
                self._write_fallback(run, rank)
        if replaced:
            info = self.recovery.last_regroup or {}
            note = self._note_of(self.recovery.generation - 1)
            self.recovered(run, note, info)

    def _write_fallback(self, run: Any, rank: int) -> None:
        key = fallback_key(int(self.attempt) - 1, rank)
        try:
            store = self._store()
            if not store.check([key]):
                return
            got = json.loads(store.get(key))
        except Exception as e:  # noqa: BLE001 - the store's view is a bonus, never fatal
            log.warning("could not read the previous attempt's in-place fallback: %s", e)
            return
        step = got.get("step")
        run.meter.event(
            recovery_record(
                path=WHOLE_RESTART,
                failed_ranks=[rank],
                from_step=int(step) if isinstance(step, int) else run.start_step,
                step=None,
                phases={},
                why=str(got.get("why", "")),
                attempt=run.attempt,
            )
        )

    def recovered(self, run: Any, note: dict[str, Any], info: dict[str, Any]) -> None:
        """The record of the recovery just done, held until its redone steps are done; the
        rollback as the attempt's ``restore`` (tier ``in-place``: the survivors' memory)."""
        memory = self.inplace.memory_event if info.get("source") == "memory" else None
        tier = memory["tier"] if memory else IN_PLACE_TIER  # the memory tier's, FSDP2
        restore = {"type": "restore", "step": run.start_step, "tier": tier}
        run.meter.event({**restore, "restore_s": self.restore_s()})
        phases = {"detection_s": float(note.get("detection_s", 0.0))}
        phases.update(info.get("phases", {}))
        step = int(info.get("step", run.start_step))
        if memory:
            how = f"rolled back to the memory tier's step {step} (each rank its own shard)"
        elif info.get("live"):
            how = f"resumed from the survivors' live state at the start of step {step}"
        else:
            how = f"rolled back to the in-memory snapshot of step {step}"
        self._pending = recovery_record(
            path=IN_PLACE,
            failed_ranks=list(info.get("replaced", [])),
            from_step=int(note.get("from_step", step)),
            step=step,
            phases=phases,
            why=f"a peer's process was lost and replaced (generation {self.recovery.generation}); "
            + how,
            attempt=run.attempt,
        )
        self._redo_from = time.monotonic()
        self.on_step(run, step)

    def on_step(self, run: Any, step: int) -> None:
        """After each recorded step: the pending record once the lost steps are redone."""
        self.progress()
        rec = self._pending
        if rec is not None and step >= rec["from_step"]:
            self._write(run, done=True)

    def close(self, run: Any) -> None:
        if self._pending is not None:
            self._write(run, done=False)

    def _write(self, run: Any, done: bool) -> None:
        rec, self._pending = self._pending, None
        rec["phases"]["redo_s"] = time.monotonic() - self._redo_from
        if not done:
            rec["redo_done"] = False  # the attempt ended before the lost steps were redone
        if run.rank == 0 and run.meter is not None:
            run.meter.event(rec)


class RecoverableStep:
    """``with run.recoverable(step) as s: ...; step = s.next`` (see the module docstring).
    Without in-place recovery: ``s.next`` is ``step + 1`` and every error goes through."""

    def __init__(self, run: Any, step: int) -> None:
        self._run, self.step, self.next, self.recovered = run, step, step + 1, False
        inplace = run._inplace
        self._inner = inplace.recovery.step(step) if inplace is not None else None

    def __enter__(self) -> RecoverableStep:
        if self._inner is not None:
            self._inner.__enter__()
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        inner, run = self._inner, self._run
        if inner is None:
            return False
        if exc is None or not (inner._recovery.enabled and regroup.is_peer_loss(exc)):
            inner.__exit__(kind, exc, tb)
            self.next = inner.next
            return False
        ledger = run._inplace_ledger
        note = ledger.fault(run, run.step)
        # The attempt ends here: what follows is a restart gap until the redone steps.
        run.meter.close(f"inplace: a peer was lost ({type(exc).__name__}: {str(exc)[:200]})")
        try:
            with run.watchdog.phase("checkpoint"):
                inner.__exit__(kind, exc, tb)  # regroup, roll back, rebuild
        except regroup.InPlaceFallback as e:
            note_fallback(ledger._store(), ledger.attempt, run.rank, str(e), run.step)
            raise
        run._reopen_after_regroup(inner.next)
        ledger.recovered(run, note, run._inplace.recovery.last_regroup or {})
        self.next, self.recovered = inner.next, True
        return True
