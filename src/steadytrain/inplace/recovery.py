"""``Recovery``: what a plain PyTorch loop holds to survive a peer's death in place.

    from steadytrain.inplace import Recovery

    recovery = Recovery(replicated={"model": model, "optim": optim},
                        per_rank={"loader": loader})
    step = recovery.start()                      # init_process_group, or rejoin (a replacement)
    ddp = recovery.wrap(lambda: DistributedDataParallel(model))  # rebuilt on every regroup
    while step < steps:
        with recovery.step(step) as s:           # a lost peer: regroup, restore, go on
            loss = ddp(batch_of(loader)).mean(); loss.backward(); optim.step()
            optim.zero_grad()
        step = s.next                            # step + 1, or the step to (re)do
    recovery.close()                             # drops the DDP, then the process groups

Run under the keeper (``torchrun ... -m steadytrain.inplace.keeper train.py``); without it
(or with it off) ``Recovery`` only initialises the group and lets every error through.

``replicated`` states are the same on every rank (DDP's model and optimizer): a replaced
rank receives them from the lowest surviving rank. ``per_rank`` states (the loader, the
generators) are this rank's alone: a replaced rank reads its own back from torchrun's
store (live.py's ``Slots``: two keys per rank and kind, however long the run).

The recovery point is **live** by default (live.py): at the start of every step each rank
keeps a copy of its per-rank states and the torch and ``random`` generators (in memory and
in the store), and of the replicated states only what is not an optimizer's tensor (a
module's buffers, plain values); an optimizer step pre-hook notes whether the step already
called ``optimizer.step()``. With DDP a lost peer surfaces in the forward or backward, before
that call: the survivors still hold the start of the failed step in their live model and
optimizer, so they restore only their per-rank states, the replaced rank receives the rest
from a survivor, and the step is done again, nothing earlier. So the parameters and the
optimizers' state must change only through the replicated optimizers' ``step()``. A rank
lost in its ``optimizer.step()`` or the loop's tail leaves its peers live at the next step:
its state of that step was published at its optimizer's step pre-hook (live.py's ``Ahead``,
used only if every survivor proved the loop changes no per-rank state after
``optimizer.step()``); one lost between its backward and that hook still falls back.

``every_steps=K`` (> 0) adds in-memory **snapshots** as a safety net, for a loop where a
collective can fail after ``optimizer.step()`` (a survivor that stepped holds no live start):
every K steps, at the start of a step, a copy of each state (``state_dict()``). The
parameters and state of the replicated optimizers are copied by a background thread while
the step's forward and backward run, and each optimizer's ``step()`` waits for that copy
(snapshot.py; ``background=False``: all of it at the start of the step). Two snapshots are
kept (a rank may die between its peers' snapshot and its own); a regroup that cannot use
the live states rolls back to the newest one every rank holds and redoes from there.

``restore_from`` replaces all of that for states no survivor can give (FSDP2's shards,
each rank's own; ``run_inplace.py`` passes the memory tier's restore): no live point or
snapshot is kept, the regroup rebuilds the wrapped objects (the checkpointer) first and
then every rank, the replacement included (``restore_replaced``), restores from outside.

Only an error of a collective whose peer is gone (``regroup.is_peer_loss``), raised inside
``with recovery.step(...)``, is recovered; any other error goes on as it would without
``Recovery``. Every doubt (a regroup that times out, no live step and no snapshot all ranks
hold, more than ``STEADYTRAIN_INPLACE_MAX`` regroups) raises ``InPlaceFallback``: the
process ends with it, and torchrun's whole restart takes over, from durable or memory-tier
checkpoints as today.
"""

from __future__ import annotations

import copy
import datetime
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.checkpoint import torch_private as tp
from steadytrain.inplace import regroup
from steadytrain.inplace.contract import ENV_FD, ENV_INCARNATION, ENV_MAX, ENV_ON
from steadytrain.inplace.live import RNG as _RNG
from steadytrain.inplace.live import SLOTS, Ahead, Live, Slots, own_state, set_rng_state, take
from steadytrain.inplace.snapshot import Copy, copy_state, deferrable

__all__ = ["Rebuilt", "Recovery", "Step", "copy_state"]

log = logging.getLogger("steadytrain.inplace")

_KEEP = SLOTS  # snapshots in memory: as many as the store keeps per-rank states for


class Rebuilt:
    """An object built over the process group (DDP), built again after each regroup. Call
    it or use its attributes as the object itself; hold no other reference to the object
    (an old DDP left alive keeps its hooks on the parameters and its dead group)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self.current: Any = factory()

    def drop(self) -> None:
        if self.current is not None:
            tp.ddp_remove_hooks(self.current)
        self.current = None

    def rebuild(self) -> None:
        if self.current is not None:  # else dropped already, and collected (_recover)
            self.drop()
            gc.collect()
        self.current = self._factory()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.current(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["current"], name)


class Step:
    """One step's context (``with recovery.step(step) as s``); ``s.next`` after the block."""

    def __init__(self, recovery: Recovery, step: int) -> None:
        self._recovery, self.step, self.next = recovery, step, step + 1
        self.recovered = False  # True: a peer was lost and the states rolled back to ``next``

    def __enter__(self) -> Step:
        self._recovery._before(self.step)
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self._recovery._stepped()
            return False
        if not self._recovery.enabled or not regroup.is_peer_loss(exc):
            return False
        self.next = self._recovery._recover(exc)
        self.recovered = True
        return True


class Recovery:
    def __init__(
        self,
        *,
        replicated: dict[str, Any],
        per_rank: dict[str, Any] | None = None,
        every_steps: int = 0,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        regroup_timeout_s: float = 60.0,
        background: bool = True,
        restore_from: Callable[[bool], int] | None = None,
    ) -> None:
        if not isinstance(every_steps, int) or every_steps < 0:
            raise ValueError(
                f"every_steps must be an integer >= 0 (0: no in-memory snapshot, the "
                f"survivors' live state is the recovery point; K: also a snapshot every K "
                f"steps), not {every_steps!r}"
            )
        for name, obj in {**replicated, **(per_rank or {})}.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"Recovery state {name!r} ({type(obj).__name__}) has no state_dict() / "
                    "load_state_dict(): pass objects that save and load their state"
                )
        self.replicated, self.per_rank = replicated, dict(per_rank or {})
        # Restores every state from outside the process (the memory tier: FSDP2's shards are
        # each rank's own), after the regroup and the rebuild; called with whether this
        # process is the replacement, returns the step. Then nothing is
        # kept live or snapshotted here, and a replacement restores once its caller built
        # what the restore needs (``restore_replaced``).
        self.restore_from = restore_from
        self.every_steps, self.backend = every_steps, backend
        self.timeout_s, self.regroup_timeout_s = timeout_s, regroup_timeout_s
        self.enabled = os.environ.get(ENV_ON) == "1"
        self.incarnation = int(os.environ.get(ENV_INCARNATION, "0"))
        self.max_regroups = int(os.environ.get(ENV_MAX, "3"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._fd = int(os.environ[ENV_FD]) if self.enabled and ENV_FD in os.environ else None
        self._snaps: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # complete ones
        self._writing: Copy | None = None  # the snapshot being copied (snapshot.py)
        self._live: Live | None = None  # the start of the step being run (live.py)
        self._optim_stepped = False  # whether that step called a replicated optimizer.step()
        self._slots = Slots(
            self._the_store, f"steadytrain/inplace/{self._attempt}/state/r{self.rank}"
        )
        self._ahead = Ahead(self._slots)  # the next step's per-rank state, at optimizer.step
        # The replicated optimizers: their step() ends the live recovery point of the step,
        # and waits for the snapshot's copy of the tensors it changes, which a background
        # thread makes (snapshot.py). Off: the whole copy blocks the loop at the start of the
        # step, as before.
        self._optims = [o for o in replicated.values() if isinstance(o, torch.optim.Optimizer)]
        self.background = background and bool(self._optims)
        if self.enabled:
            for optim in self._optims:
                optim.register_step_pre_hook(self._optimizer_steps)
        if self.enabled and self.background:
            for optim in self._optims:
                optim.register_step_pre_hook(lambda *_: self._settle())
        if self.enabled and not self._optims and replicated:
            log.warning(
                "in-place recovery: no torch.optim.Optimizer among the replicated states, so "
                "no step's start can be proven live; a lost peer is recovered from snapshots "
                "only (every_steps=%d%s)",
                every_steps,
                ": none, so by the whole restart" if not every_steps else "",
            )
        self._rebuilt: list[Rebuilt] = []
        self._store: dist.Store | None = None
        self._joined: tuple[float, list[int], float] = (0.0, [], 0.0)
        self.regroups = 0
        self.generation = 0
        # The newest regroup, for the caller's records (Run's inplace_recovery): the step
        # agreed, the replaced ranks, and its phases in seconds.
        self.last_regroup: dict[str, Any] | None = None

    # -- start ----------------------------------------------------------------------------

    def start(self) -> int:
        """Initialise the default process group; the step to start from: 0 for a first
        process, the agreed step for a replacement (its states already restored)."""
        if not self.enabled:
            if not dist.is_initialized():
                timeout = datetime.timedelta(seconds=self.timeout_s)
                dist.init_process_group(self.backend, timeout=timeout)
            return 0
        if dist.is_initialized() and regroup.formed(self._attempt) is None:
            raise RuntimeError(
                "Recovery.start() initialises the process group itself (on a prefix of "
                "torchrun's store that a regroup can renew): do not call "
                "init_process_group before it"
            )
        if self.incarnation == 0:
            if regroup.formed(self._attempt) is None:  # else run_inplace.form_group did
                regroup.join(
                    self.backend, self.rank, self.world, self.timeout_s, self._attempt, first=True
                )
            return 0
        if self.restore_from is not None:
            self._join_and_exchange(replaced=True)
            return 0  # the step comes from restore_replaced()
        return self._regroup(replaced=True)

    def restore_replaced(self) -> int:
        """A replacement under ``restore_from``: restore now (collective with the survivors'
        restore in ``_regroup``); the step."""
        return self._restore_from(True, *self._joined)

    def _join(self, replaced: bool) -> float:
        """Join the next group (a replacement: unless ``form_group`` already did); when the
        join began."""
        t0 = time.monotonic()
        generation = regroup.formed(self._attempt) if replaced else None
        if generation is None:
            generation, _ = regroup.join(
                self.backend, self.rank, self.world, self.regroup_timeout_s, self._attempt
            )
        self.generation = generation
        return t0

    def _join_and_exchange(self, replaced: bool) -> None:
        """Join the next group and learn who is replaced (``restore_from``: nothing else to
        agree here, the restore agrees on its step)."""
        t0 = self._join(replaced)
        reports = regroup.exchange(regroup.Report(self.rank, (), replaced))
        self._joined = (t0, [r.rank for r in reports if r.replaced], time.monotonic())

    def _restore_from(
        self, me: bool, t0: float, replaced: list[int], t_agreed: float, rebuild_s: float = 0.0
    ) -> int:
        try:
            step = self.restore_from(me)  # type: ignore[misc]
        except regroup.InPlaceFallback:
            raise
        except Exception as e:  # noqa: BLE001 - a half-restored state must never train
            raise regroup.restore_failed(self.rank, e) from e
        self.last_regroup = {
            "step": step,
            "live": False,
            "source": "memory",
            "replaced": replaced,
            "phases": {
                "regroup_s": t_agreed - t0,
                # a replacement builds its checkpointer in between: counted as restore
                "restore_s": time.monotonic() - t_agreed - rebuild_s,
                "rebuild_s": rebuild_s,
            },
        }
        return step

    def wrap(self, factory: Callable[[], Any]) -> Rebuilt:
        """``factory()`` now and after every regroup (DDP over the new default group)."""
        built = Rebuilt(factory)
        self._rebuilt.append(built)
        return built

    def step(self, step: int) -> Step:
        return Step(self, step)

    def close(self) -> None:
        """Drop the wrapped objects, then every process group (instead of a plain
        ``destroy_process_group``). In that order: a DDP that outlives its group holds the
        group's last reference, and its release at interpreter exit joins gloo's threads
        with the GIL held while one of them waits for the GIL (a hang, seen here)."""
        self._settle()
        for built in self._rebuilt:
            built.drop()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- snapshots ------------------------------------------------------------------------

    def _before(self, step: int) -> None:
        """The start of ``step``: its live recovery point, and a snapshot every
        ``every_steps`` steps."""
        if not self.enabled:
            return
        self._optim_stepped = False
        own = own_state(self.per_rank)
        if self._optims:  # without one, no step's start is provably live
            # To the store first (unless the optimizer's pre-hook published exactly this): a
            # rank dying before it is there leaves its peers live at a step it cannot resume.
            self._ahead.write(step, own)
        states = {k: v.state_dict() for k, v in self.replicated.items()}
        defer = deferrable(self._optims)
        if self._optims:
            self._live = take(step, states, own, defer, self._live)
        if self.every_steps and step % self.every_steps == 0 and step not in self._snaps:
            self._snapshot(step, states, own, defer if self.background else set())

    def _snapshot(
        self, step: int, states: dict[str, Any], own: dict[str, Any], defer: set[int]
    ) -> None:
        self._settle()  # one copy at a time: the previous one becomes a snapshot first
        reuse: Any = None
        while len(self._snaps) >= _KEEP:  # the oldest goes; its tensors take the new copy
            reuse = self._snaps.pop(min(self._snaps))[0]
        self._writing = Copy.start(step, states, reuse, own, defer)
        if not self.background:
            self._settle()
        self._slots.put("snap", step // self.every_steps, step, own)

    def _optimizer_steps(self, *_: Any) -> None:
        """A step's first optimizer step (its gradient all-reduce is done): this rank's
        per-rank state goes to the store as its state of the next step (``Ahead``)."""
        if not self._optim_stepped and self._live is not None:
            self._ahead.publish(self._live.step + 1, own_state(self.per_rank))
        self._optim_stepped = True

    def _live_step(self) -> int | None:
        """The step whose start this rank still holds live (None: an optimizer stepped)."""
        return None if self._live is None or self._optim_stepped else self._live.step

    def _settle(self) -> None:
        """Wait for the snapshot being copied; it joins the complete ones unless it failed."""
        writing, self._writing = self._writing, None
        if writing is not None and writing.wait():
            self._snaps[writing.step] = (writing.tree, writing.own)

    def _stepped(self) -> None:
        if self._fd is not None:  # tells the keeper this process is past its start
            os.write(self._fd, b"s")
            os.close(self._fd)
            self._fd = None

    def _the_store(self) -> dist.Store:
        if self._store is None:
            self._store = regroup.store(self.regroup_timeout_s)
        return self._store

    # -- recovery -------------------------------------------------------------------------

    def _recover(self, exc: BaseException) -> int:
        self._settle()  # its sources are intact: optimizer.step() waited for it
        self.regroups += 1
        if self.regroups > self.max_regroups:
            raise regroup.InPlaceFallback(
                f"rank {self.rank}: a peer was lost again after {self.max_regroups} in-place "
                f"regroups (STEADYTRAIN_INPLACE_MAX); torchrun's whole restart takes over"
            ) from exc
        for built in self._rebuilt:
            built.drop()
        gc.collect()
        regroup.leave(self.backend)
        return self._regroup(replaced=False)

    def _regroup(self, replaced: bool) -> int:
        """Join the next group, agree on the step, restore the states, rebuild. The step."""
        if self.restore_from is not None:  # rebuilt first: the restore runs on its groups
            self._join_and_exchange(replaced)
            t0, lost, t_agreed = self._joined
            t_rebuild = time.monotonic()
            for built in self._rebuilt:
                built.rebuild()
            rebuild_s = time.monotonic() - t_rebuild
            return self._restore_from(replaced, t0, lost, t_agreed, rebuild_s)
        t0 = self._join(replaced)
        try:
            snaps, _ = self._slots.read("snap") if replaced else ({}, ())
            lives, ahead = self._slots.read("live") if replaced else ({}, ())
            held = tuple(sorted(snaps)) if replaced else tuple(sorted(self._snaps))
            live = None if replaced else self._live_step()
            own_live, proven = tuple(sorted(lives)), self._ahead.proven(live)
            mine = regroup.Report(self.rank, held, replaced, live, own_live, ahead, proven)
            reports = regroup.exchange(mine)
            step, source, is_live = regroup.agree(reports)
            t_agreed = time.monotonic()
            self._restore(step, source, is_live, snaps if replaced else None, lives)
        except regroup.InPlaceFallback:
            raise
        except Exception as e:  # noqa: BLE001 - a half-restored state must never train
            raise regroup.restore_failed(self.rank, e) from e
        t_restored = time.monotonic()
        for built in self._rebuilt:
            built.rebuild()
        self.last_regroup = {
            "step": step,
            "live": is_live,
            "replaced": [r.rank for r in reports if r.replaced],
            "phases": {
                "regroup_s": t_agreed - t0,
                "restore_s": t_restored - t_agreed,
                "rebuild_s": time.monotonic() - t_restored,
            },
        }
        return step

    def _restore(
        self,
        step: int,
        source: int,
        is_live: bool,
        snaps: dict[int, dict[str, Any]] | None,
        lives: dict[int, dict[str, Any]],
    ) -> None:
        """Every member loads the source's replicated states of ``step``: its live ones
        (``is_live``: the survivors' own per-rank states from memory, a replaced rank's from
        the store's live slots) or its snapshot (a replaced rank's per-rank states from
        ``snaps``, the store's snapshot slots; ``None`` on a survivor)."""
        live = self._live
        if is_live:
            tree = live.tree if live is not None and self.rank == source else None
        else:
            tree = self._snaps[step][0] if self.rank == source else None
        rep: list[Any] = [tree]
        dist.broadcast_object_list(rep, src=source)
        self._live = None  # the next step's start makes the next one
        self._ahead.reset()
        if snaps is None:  # a survivor: the snapshots after the agreed step are void
            self._snaps = {s: v for s, v in self._snaps.items() if s <= step}
        if is_live:
            own = lives[step] if snaps is not None or live is None else live.own
            self._load(rep[0], own, keep=False)
            return
        if snaps is not None:
            self._snaps = {step: (rep[0], snaps[step])}
        self._load(*self._snaps[step], keep=True)

    def _load(self, rep: dict[str, Any], own: dict[str, Any], keep: bool) -> None:
        """Load ``rep`` and ``own``; ``keep``: ``rep`` is a snapshot to keep pristine (a
        live tree is used once: copying it would only double the model's memory)."""
        for name, obj in self.replicated.items():
            obj.load_state_dict(copy.deepcopy(rep[name]) if keep else rep[name])
            if isinstance(obj, torch.nn.Module):
                obj.zero_grad(set_to_none=True)
        for name, obj in self.per_rank.items():
            obj.load_state_dict(copy.deepcopy(own[name]))
        set_rng_state(own[_RNG])
