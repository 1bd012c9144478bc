"""``Recovery``: what a plain PyTorch loop holds to survive a peer's death in place.

    from steadytrain.inplace import Recovery

    recovery = Recovery(replicated={"model": model, "optim": optim},
                        per_rank={"loader": loader}, every_steps=10)
    step = recovery.start()                      # init_process_group, or rejoin (a replacement)
    ddp = recovery.wrap(lambda: DistributedDataParallel(model))  # rebuilt on every regroup
    while step < steps:
        with recovery.step(step) as s:           # a lost peer: regroup, roll back, redo
            loss = ddp(batch_of(loader)).mean(); loss.backward(); optim.step()
            optim.zero_grad()
        step = s.next                            # step + 1, or the step to redo from
    recovery.close()                             # drops the DDP, then the process groups

Run under the keeper (``torchrun ... -m steadytrain.inplace.keeper train.py``); without it
(or with it off) ``Recovery`` only initialises the group and lets every error through.

Snapshots live in the process's own memory: every ``every_steps`` steps, at the start of a
step, a copy of each state (``state_dict()``), plus the torch and ``random`` generators.
The parameters and state of the replicated optimizers are copied by a background thread
while the step's forward and backward run, and each optimizer's ``step()`` waits for that
copy (snapshot.py; ``background=False``: all of it at the start of the step). So a loop
must change those tensors only through their optimizer's ``step()``. ``replicated`` states are the same on every rank (DDP's model and optimizer): a
replaced rank receives them from the lowest surviving rank. ``per_rank`` states (the
loader, the generators) are this rank's alone: each snapshot also puts them into torchrun's
store (a few KB; ``torch.save``, read back with ``weights_only=True``, since anyone on the
job's network can write to that store), where the replaced rank reads its own back. Two snapshots are
kept (a rank may die between its peers' snapshot and its own).

Only an error of a collective whose peer is gone (``regroup.is_peer_loss``), raised inside
``with recovery.step(...)``, is recovered; any other error goes on as it would without
``Recovery``. Every doubt (a regroup that times out, no step all ranks hold, more than
``STEADYTRAIN_INPLACE_MAX`` regroups) raises ``InPlaceFallback``: the process ends with it,
and torchrun's whole restart takes over, from durable or memory-tier checkpoints as today.
"""

from __future__ import annotations

import copy
import datetime
import gc
import io
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.checkpoint import torch_private as tp
from steadytrain.inplace import regroup
from steadytrain.inplace.contract import ENV_FD, ENV_INCARNATION, ENV_MAX, ENV_ON
from steadytrain.inplace.snapshot import Copy, copy_state, deferrable

__all__ = ["Rebuilt", "Recovery", "Step", "copy_state"]

_KEEP = 2
_RNG = "__steadytrain_rng__"


def _dumps(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _loads(data: bytes) -> dict[str, Any]:
    """A per-rank state back from the store: tensors and plain values only (a state that
    needs more fails here, and the regroup falls back to the whole restart)."""
    return torch.load(io.BytesIO(data), weights_only=True)


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
        every_steps: int = 1,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        regroup_timeout_s: float = 60.0,
        background: bool = True,
    ) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, not {every_steps}")
        for name, obj in {**replicated, **(per_rank or {})}.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"Recovery state {name!r} ({type(obj).__name__}) has no state_dict() / "
                    "load_state_dict(): pass objects that save and load their state"
                )
        self.replicated, self.per_rank = replicated, dict(per_rank or {})
        self.every_steps, self.backend = every_steps, backend
        self.timeout_s, self.regroup_timeout_s = timeout_s, regroup_timeout_s
        self.enabled = os.environ.get(ENV_ON) == "1"
        self.incarnation = int(os.environ.get(ENV_INCARNATION, "0"))
        self.max_regroups = int(os.environ.get(ENV_MAX, "3"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"steadytrain/inplace/{self._attempt}/state/r{self.rank}"
        self._fd = int(os.environ[ENV_FD]) if self.enabled and ENV_FD in os.environ else None
        self._snaps: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # complete ones
        self._writing: Copy | None = None  # the snapshot being copied (snapshot.py)
        # The replicated optimizers: their step() waits for the snapshot's copy of the
        # tensors it changes, which a background thread makes (snapshot.py). Off: the whole
        # copy blocks the loop at the start of the step, as before.
        self._optims = [o for o in replicated.values() if isinstance(o, torch.optim.Optimizer)]
        self.background = background and bool(self._optims)
        if self.enabled and self.background:
            for optim in self._optims:
                optim.register_step_pre_hook(lambda *_: self._settle())
        self._rebuilt: list[Rebuilt] = []
        self._store: dist.Store | None = None
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
        if dist.is_initialized():
            raise RuntimeError(
                "Recovery.start() initialises the process group itself (on a prefix of "
                "torchrun's store that a regroup can renew): do not call "
                "init_process_group before it"
            )
        if self.incarnation == 0:
            regroup.join(
                self.backend, self.rank, self.world, self.timeout_s, self._attempt, first=True
            )
            return 0
        return self._regroup(replaced=True)

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
        if not self.enabled or step % self.every_steps or step in self._snaps:
            return
        self._settle()  # one copy at a time: the previous one becomes a snapshot first
        reuse: Any = None
        while len(self._snaps) >= _KEEP:  # the oldest goes; its tensors take the new copy
            reuse = self._snaps.pop(min(self._snaps))[0]
        own = {k: copy.deepcopy(v.state_dict()) for k, v in self.per_rank.items()}
        own[_RNG] = (torch.get_rng_state(), random.getstate())
        states = {k: v.state_dict() for k, v in self.replicated.items()}
        defer = deferrable(self._optims) if self.background else set()
        self._writing = Copy.start(step, states, reuse, own, defer)
        if not self.background:
            self._settle()
        store = self._the_store()
        store.set(f"{self._prefix}/s{step}", _dumps(own))
        store.set(f"{self._prefix}/steps", json.dumps(sorted({*self._snaps, step})))

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
        self._settle()  # its sources are intact: the peer loss came before optimizer.step()
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

    def _held_steps(self, replaced: bool) -> tuple[int, ...]:
        if not replaced:
            return tuple(sorted(self._snaps))
        store, key = self._the_store(), f"{self._prefix}/steps"
        if not store.check([key]):  # the dead process never snapshotted: agree() falls back
            return ()
        return tuple(int(s) for s in json.loads(store.get(key)))

    def _regroup(self, replaced: bool) -> int:
        """Join the next group, agree on the step, restore the states, rebuild. The step."""
        t0 = time.monotonic()
        self.generation, _ = regroup.join(
            self.backend, self.rank, self.world, self.regroup_timeout_s, self._attempt
        )
        try:
            held = self._held_steps(replaced)
            reports = regroup.exchange(regroup.Report(self.rank, held, replaced))
            step, source = regroup.agree(reports)
            t_agreed = time.monotonic()
            rep: list[Any] = [self._snaps[step][0] if self.rank == source else None]
            dist.broadcast_object_list(rep, src=source)
            if replaced:
                own = _loads(self._the_store().get(f"{self._prefix}/s{step}"))
                self._snaps = {step: (rep[0], own)}
            else:
                self._snaps = {s: v for s, v in self._snaps.items() if s <= step}
            self._load(*self._snaps[step])
        except regroup.InPlaceFallback:
            raise
        except Exception as e:  # noqa: BLE001 - a half-restored state must never train
            raise regroup.InPlaceFallback(
                f"rank {self.rank}: in-place restore failed ({type(e).__name__}: {e}); "
                "torchrun's whole restart takes over"
            ) from e
        t_restored = time.monotonic()
        for built in self._rebuilt:
            built.rebuild()
        self.last_regroup = {
            "step": step,
            "replaced": [r.rank for r in reports if r.replaced],
            "phases": {
                "regroup_s": t_agreed - t0,
                "restore_s": t_restored - t_agreed,
                "rebuild_s": time.monotonic() - t_restored,
            },
        }
        return step

    def _load(self, rep: dict[str, Any], own: dict[str, Any]) -> None:
        for name, obj in self.replicated.items():
            obj.load_state_dict(copy.deepcopy(rep[name]))  # the snapshot stays pristine
            if isinstance(obj, torch.nn.Module):
                obj.zero_grad(set_to_none=True)
        for name, obj in self.per_rank.items():
            obj.load_state_dict(copy.deepcopy(own[name]))
        torch_rng, py_rng = own[_RNG]
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
