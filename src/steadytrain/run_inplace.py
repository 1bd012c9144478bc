"""In-place recovery inside ``Run`` (issue 44 section 2): the decision, the ledger record and
the glue between ``Run`` and ``steadytrain.inplace.Recovery``.

Opt in with ``Run(..., recovery={"inplace": True})`` (``[recovery]`` in a ``steadytrain
train`` config) and start the job under the keeper (``torchrun ... -m
steadytrain.inplace.keeper train.py``). Then ``Run`` forms the process group on a
per-attempt prefix of torchrun's store (a whole restart never reads the previous attempt's
gloo addresses, pytorch/pytorch#135712), keeps the start of every step as the live recovery
point (``steadytrain.inplace.live``; ``every_steps=K`` adds an in-memory snapshot every K
steps), and a step run inside ``with run.recoverable(step) as s:`` that loses a peer
regroups, restores and goes on from ``s.next``. Everything else, and every doubt, is
today's whole restart.

- ``decide`` (pure, policy): in place or not, and why -- the one place that says so;
- ``classify`` (pure): a fallback's message -> a short reason the report groups by;
- ``recovery_record`` (pure): the ledger's ``inplace_recovery`` record (docs/format.md);
- ``InPlace`` (mechanism): a ``Recovery`` over ``Run``'s states plus the rebuilt
  checkpointer (its side groups die with the broken group, so it is built again after
  each regroup, before the user's DDP, in the order a replacement builds them);
- FSDP2 (a module of the states sharded by ``fully_shard``): each rank's shard is its own,
  so no survivor can hand the replacement its state. Every rank restores its own shard from
  the memory tier instead (the node's tmpfs outlives a process), at the newest step every
  rank holds, on the checkpointer rebuilt over the new group; the FSDP2 modules are pointed
  at the new default group first. The model is sharded before ``Run``, so the loop forms
  the group first with ``form_group`` (``fully_shard`` needs it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.checkpoint import torch_private as tp
from steadytrain.errors import ConfigError
from steadytrain.inplace import regroup
from steadytrain.inplace.contract import ENV_INCARNATION, ENV_ON
from steadytrain.inplace.recovery import Rebuilt

__all__ = [
    "InPlace",
    "RecoveryConfig",
    "classify",
    "decide",
    "form_group",
    "recovery_config",
    "recovery_record",
]

log = logging.getLogger("steadytrain.inplace")

IN_PLACE, WHOLE_RESTART = "in_place", "whole_restart"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """``[recovery]``: ``inplace`` (default off), the in-memory snapshot interval
    ``every_steps`` (default 0: none, the survivors' live state at the start of the failed
    step is the recovery point, which costs a DDP step almost nothing; K > 0: also a copy
    every K steps, the safety net of a loop whose collectives can fail after
    ``optimizer.step()``, where nothing is live), the states that are each rank's own (``per_rank``: restored from the
    rank's own snapshot; every other state is the same on every rank, DDP's model and
    optimizer, and a replaced rank receives it from a survivor), and how long a regroup may
    take before the whole restart takes over (``regroup_timeout_s``)."""

    inplace: bool = False
    every_steps: int = 0
    per_rank: tuple[str, ...] = ("loader",)
    regroup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.inplace, bool):
            raise ConfigError(f"recovery.inplace must be true or false, not {self.inplace!r}")
        if (
            not isinstance(self.every_steps, int)
            or isinstance(self.every_steps, bool)
            or self.every_steps < 0
        ):
            raise ConfigError(
                f"recovery.every_steps must be an integer >= 0 (the steps between in-memory "
                f"snapshots; 0, the default: none, the survivors' live state is the recovery "
                f"point), not {self.every_steps!r}"
            )
        if not (isinstance(self.regroup_timeout_s, (int, float)) and self.regroup_timeout_s > 0):
            raise ConfigError(
                f"recovery.regroup_timeout_s must be a number of seconds > 0, not "
                f"{self.regroup_timeout_s!r}"
            )
        object.__setattr__(self, "per_rank", tuple(self.per_rank))


def recovery_config(given: RecoveryConfig | Mapping[str, Any] | None) -> RecoveryConfig:
    if given is None:
        return RecoveryConfig()
    if isinstance(given, RecoveryConfig):
        return given
    known = {f.name for f in dataclasses.fields(RecoveryConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(
            f"unknown recovery key(s) {unknown}: the keys are {sorted(known)} (docs/operations.md, "
            '"In-place recovery")'
        )
    return RecoveryConfig(**dict(given))


def decide(
    cfg: RecoveryConfig,
    env: Mapping[str, str],
    *,
    world_size: int,
    group_exists: bool,
    rebuildable_checkpoint: bool,
) -> tuple[bool, str]:
    """(in place?, why): whether ``Run`` forms its group through the in-place machinery.
    Any doubt says no: the job then runs exactly as without the option (a fault costs the
    whole restart), and the reason is said once and recorded."""
    if not cfg.inplace:
        return False, "recovery.inplace is off"
    if ENV_ON not in env:
        return False, (
            "not under the keeper (start the job with `torchrun ... -m "
            "steadytrain.inplace.keeper SCRIPT`, or `srun ... python -m "
            "steadytrain.inplace.keeper SCRIPT`)"
        )
    if env[ENV_ON] != "1":
        return False, (
            "the keeper turned it off (it needs torchrun's shared store: unset "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE; or srun's tasks, whose rank 0 keeper "
            "hosts one)"
        )
    if world_size < 2:
        return False, "a single rank has no peer to recover with"
    if group_exists:
        return False, (
            "the process group existed before Run (in-place recovery forms it itself, on a "
            "prefix a regroup can renew): let Run create it, or, for a model sharded "
            "before Run (FSDP2), call steadytrain.run_inplace.form_group first"
        )
    if not rebuildable_checkpoint:
        return False, (
            "a ready-made checkpointer cannot be rebuilt after a regroup (its groups die "
            "with the broken one): pass the checkpoint settings instead"
        )
    return True, "under the keeper, on a store that outlives the training processes"


def form_group(
    recovery: RecoveryConfig | Mapping[str, Any] | None = None, *, timeout_s: float = 600.0
) -> bool:
    """Form the process group as ``Run`` would with in-place recovery, before ``Run``: for
    a loop that shards its model first (FSDP2's ``fully_shard`` needs the group, and
    ``Run``'s states need the sharded model). True: formed (a replacement: it joined its
    survivors' new group), and ``Run`` takes it over; False: in-place recovery is off
    (``Run`` says why), nothing was done, and the loop forms its group as usual."""
    cfg = recovery_config(recovery)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    exists = dist.is_initialized()
    if not decide(
        cfg, os.environ, world_size=world, group_exists=exists, rebuildable_checkpoint=True
    )[0]:
        return False
    rank = int(os.environ.get("RANK", "0"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    first = int(os.environ.get(ENV_INCARNATION, "0")) == 0
    wait_s = timeout_s if first else float(cfg.regroup_timeout_s)
    regroup.join("gloo", rank, world, wait_s, attempt, first=first)
    return True


def sharded_modules(states: Mapping[str, Any]) -> list[torch.nn.Module]:
    """The states' modules that FSDP2 sharded (their shards are each rank's own)."""
    from torch.distributed.fsdp import FSDPModule

    return [
        m
        for m in states.values()
        if isinstance(m, torch.nn.Module) and any(isinstance(x, FSDPModule) for x in m.modules())
    ]


# A fallback's message (keeper's or ``InPlaceFallback``'s) -> the reason the report groups by.
_KINDS = (
    ("could not form a new process group", "regroup_timeout"),
    ("no snapshot step is held by every rank", "no_common_step"),
    ("every rank is a replacement", "no_survivor"),
    ("lost again after", "repeated_fault"),
    ("before it completed a step", "repeated_fault"),
    ("in-place recoveries already", "repeated_fault"),
    ("in-place restore failed", "restore_failed"),
    ("its own verdict", "exit_status"),
    ("not a process fault", "not_a_process_fault"),
    ("in-place recovery is off", "off"),
)


def classify(message: str) -> str:
    """A short reason for a fallback's message ("other" when none fits)."""
    return next((kind for text, kind in _KINDS if text in message), "other")


def recovery_record(
    *,
    path: str,
    failed_ranks: list[int],
    from_step: int,
    step: int | None,
    phases: Mapping[str, float],
    why: str,
    attempt: int,
    t: float | None = None,
) -> dict[str, Any]:
    """The ledger's ``inplace_recovery`` record (docs/format.md): ``path`` "in_place" or
    "whole_restart"; ``from_step`` the step the fault interrupted, ``step`` the one rolled
    back to (None: none, it fell back); ``phases`` in seconds (detection, regroup, restore,
    rebuild, redo: what was measured); ``fallback`` the short reason of a fallback."""
    if path not in (IN_PLACE, WHOLE_RESTART):
        raise ValueError(f"path must be {IN_PLACE!r} or {WHOLE_RESTART!r}, not {path!r}")
    rec: dict[str, Any] = {
        "type": "inplace_recovery",
        "t": time.time() if t is None else t,
        "attempt": int(attempt),
        "path": path,
        "failed_ranks": sorted(int(r) for r in failed_ranks),
        "from_step": int(from_step),
        "step": None if step is None else int(step),
        "phases": {k: max(0.0, float(v)) for k, v in phases.items()},
        "why": why,
    }
    if path == WHOLE_RESTART:
        rec["fallback"] = classify(why)
    return rec


class _Counters:
    """Run's own counters that a rollback must restore with the states (tokens seen)."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def state_dict(self) -> dict[str, int]:
        return {"tokens_seen": int(self._run.tokens_seen)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self._run.tokens_seen = int(sd["tokens_seen"])


class _RebuiltCheckpointer(Rebuilt):
    """The checkpointer, closed before a regroup and built again after it. A close that
    fails (its save in flight lost the peer) is logged: that save never committed, and the
    newest committed checkpoint stays the durable recovery point."""

    def drop(self) -> None:
        current, self.current = self.current, None
        if current is None:
            return
        try:
            current.close(keep_memory=True)  # the memory tier's copies: the regroup's source
        except Exception as e:  # noqa: BLE001 - the save lost its peer; nothing to keep
            log.warning("in-place recovery: the checkpointer's save in flight failed: %s", e)


class InPlace:
    """A ``Recovery`` over ``Run``'s states (mechanism; ``decide`` chose to use it)."""

    def __init__(self, cfg: RecoveryConfig, states: Mapping[str, Any], run: Any) -> None:
        from steadytrain.inplace.recovery import Recovery

        self._run, self.sharded = run, sharded_modules(states)
        self.memory_event: dict[str, Any] | None = None  # the newest restore from memory
        per_rank = {k: v for k, v in states.items() if k in cfg.per_rank}
        per_rank["__steadytrain_run__"] = _Counters(run)
        replicated = {k: v for k, v in states.items() if k not in cfg.per_rank}
        if self.sharded:  # FSDP2: every state comes back from the memory tier, nothing live
            per_rank, replicated = {}, {}
        self.recovery = Recovery(
            replicated=replicated,
            per_rank=per_rank,
            every_steps=0 if self.sharded else cfg.every_steps,
            backend="gloo",
            timeout_s=float(run._backend_timeout_s or 600.0),
            regroup_timeout_s=float(cfg.regroup_timeout_s),
            restore_from=self._from_memory if self.sharded else None,
        )
        self.checkpointer: _RebuiltCheckpointer | None = None
        self._group_name = ""  # the default group's name, which FSDP2's meshes resolve

    @property
    def replaced(self) -> bool:
        """This process replaces a lost one (the keeper's n-th incarnation, n > 0)."""
        return int(os.environ.get(ENV_INCARNATION, "0")) > 0

    def start(self) -> int:
        """Form the group (a replacement: rejoin, agree, restore); the step to start from."""
        step = self.recovery.start()
        self._group_name = dist.group.WORLD.group_name if dist.is_initialized() else ""
        return step

    def restore_replaced(self) -> int:
        """A replacement of an FSDP2 job: its shard from the memory tier (with the
        survivors, once its checkpointer is built); the step."""
        try:
            return self.recovery.restore_replaced()
        except regroup.InPlaceFallback as e:  # its reason, for the next attempt's ledger
            from steadytrain.run_inplace_step import note_fallback

            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = self.recovery._the_store()
            note_fallback(store, attempt, self._run.rank, str(e), self._run.step)
            raise

    def _from_memory(self, replaced: bool) -> int:
        """Every rank's own states from the memory tier at the newest step every rank holds
        (a collective on the rebuilt checkpointer's group); ``InPlaceFallback`` when none.
        ``replaced``: this process is the replacement in this regroup."""
        from torch.distributed.fsdp import FSDPModule

        rank = self._run.rank
        ckpt = self.checkpointer.current if self.checkpointer is not None else None
        if getattr(ckpt, "memory", None) is None:
            raise regroup.InPlaceFallback(
                f"rank {rank}: FSDP2's shards are each rank's own and the memory tier is off "
                "(checkpoint.memory.every_steps), so no snapshot step is held by every rank; "
                "torchrun's whole restart takes over"
            )
        why = tp.fsdp_rebind_groups(self.sharded, self._group_name)
        if why is not None:
            raise regroup.InPlaceFallback(
                f"rank {rank}: FSDP2 cannot follow the new group ({why}); torchrun's whole "
                "restart takes over"
            )
        for module in self.sharded:
            # A survivor: FSDP2's own recovery from a forward or backward that raised (the
            # iteration's gathers and reductions dropped, every parameter group resharded and
            # idle; else its next step's collectives differ from the replacement's). A
            # replacement has not run a step: nothing to end.
            if replaced:
                pass
            elif isinstance(module, FSDPModule) and hasattr(module, "reset_iter_state"):
                module.reset_iter_state()
            else:
                raise regroup.InPlaceFallback(
                    f"rank {rank}: a state is not the root FSDP2 module, or this torch has no "
                    "FSDPModule.reset_iter_state() to end its failed step; torchrun's whole "
                    "restart takes over"
                )
            module.zero_grad(set_to_none=True)
        ckpt.run_nonce = self._run.nonce  # a rebuilt one has none yet: only this run's copies
        event, passed = ckpt.restore_memory(self._run.states)
        if event is None:
            reasons = "; ".join(str(p.get("reason", "")) for p in passed[-2:]) or "none in memory"
            raise regroup.InPlaceFallback(
                f"rank {rank}: no snapshot step is held by every rank in the memory tier "
                f"({reasons}); torchrun's whole restart takes over"
            )
        self.memory_event = event
        self._run.tokens_seen = int(getattr(ckpt, "tokens_seen", 0) or 0)
        return int(event["step"])

    def wrap_checkpointer(self, factory: Callable[[], Any]) -> Any:
        built = _RebuiltCheckpointer(factory)
        self.recovery._rebuilt.append(built)  # rebuilt first: before any DDP the loop wraps
        self.checkpointer = built
        return built.current

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.current = None  # Run closed it already, in its closing order
        self.recovery.close()
