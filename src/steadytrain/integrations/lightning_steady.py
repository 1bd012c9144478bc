"""Lightning saves and restores through steadytrain's ``Checkpointer``: a strategy mixin.

    loader = TokenLoader(ds, seq_len=L, global_batch=G, micro_batch=M, rank=rank, world_size=W)
    trainer = L.Trainer(strategy=SteadyDDPStrategy("runs/r1", loader=loader,
                                                   checkpoint={"memory": {"every_steps": 1}}),
                        accumulate_grad_batches=loader.micro_per_step, deterministic=True,
                        callbacks=[ModelCheckpoint(every_n_train_steps=K, save_top_k=-1)], ...)
    trainer.fit(model, DataLoader(loader.as_dataset(), batch_size=None))   # no ckpt_path

**Why a strategy, not a ``CheckpointIO`` plugin.** Lightning's ``Strategy.save_checkpoint``
calls ``CheckpointIO.save_checkpoint(checkpoint, path)`` on global rank 0 only, with the
whole state already gathered there, and ``load_checkpoint`` returns one dict that Lightning
then loads with ``load_state_dict``. A sharded DCP save needs every rank (each writes its
part), as do the memory tier's peer copies and the per-rank RNG; a verified restore that
falls back to an older checkpoint is a collective decision made while loading. So the
checkpoint goes through the strategy, as Lightning's own ``FSDPStrategy`` does for its
sharded checkpoints: ``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint``,
``load_model_state_dict``, ``restore_checkpoint_after_setup`` and
``lightning_restore_optimizer`` are the strategy's public, overridable methods.
``SteadyCheckpointing`` goes before a strategy class (``SteadyDDPStrategy``,
``SteadySingleDeviceStrategy`` are the two made and tested here).

**What it does** (``LightningCheckpoints``):

- ``setup`` (fitting): after the strategy wrapped the model and made the optimizers, opens a
  ``steadytrain.Run`` over ``{"model": the LightningModule, "optimizer_0", ...: the
  optimizers, "lightning": the rest of Lightning's checkpoint dict, "loader": the
  TokenLoader's position}``. Run restores the newest good recovery point (a memory snapshot,
  else the newest committed checkpoint that verifies, falling back to older ones): weights
  and optimizer moments through DCP, the rest as JSON (``trainer_state.py``). Lightning then
  applies the rest with its own code (module and callbacks' ``on_load_checkpoint``, callback
  states, loops, schedulers, precision), exactly as from a ``.ckpt`` file: the restored dict
  is handed to Lightning's checkpoint connector (``trainer._checkpoint_connector.
  _loaded_checkpoint``, the one private name used; ``lightning_state.py``), which restores
  it right after ``setup`` (``restore_checkpoint_after_setup``). No ``ckpt_path`` is needed:
  ``fit(ckpt_path=None)`` never asks the strategy to load anything.
- ``save_checkpoint(checkpoint, path)`` (every rank: ``ModelCheckpoint`` calls
  ``trainer.save_checkpoint`` on all of them) is ``Run.save(step)``: the loop pays for
  staging, the write and COMMIT run in the background, the memory tier snapshots in
  ``step_done`` (``checkpoint.memory``). ``step`` is the dict's ``global_step``; a second
  path for a step already saved (``last.ckpt`` beside ``step=8.ckpt``) is a name for it.
- The paths ``ModelCheckpoint`` chooses name step directories (``RUN_DIR/checkpoints/
  step-NNNNNNNN``); no file is written at a path. ``remove_checkpoint(path)`` drops the name;
  a step with a name left is kept (``Checkpointer.pinned_steps``), one without is removed by
  the next save's retention unless it is among the newest ``keep_last`` committed ones (a
  damaged newest checkpoint always has one to fall back to). So "keep the best k by a
  metric" keeps the best k. The names travel in the checkpoint.
- The accounting of ``SteadytrainCallback`` (added at ``setup`` unless the trainer has one,
  which is then used), recording into this Run: crashes (``on_exception``), restart gaps,
  goodput, saves as checkpoint blocking; ``ExactResume(loader)`` (added unless the trainer
  has one for this loader) keeps the loader's position as of the last micro-batch trained.
- ``teardown`` closes the Run: the final save (the last step committed even when
  ``ModelCheckpoint`` did not save it), ``job_end``.

Outside ``fit`` (validate, test, predict, a ``trainer.save_checkpoint`` after ``fit``) the
strategy is Lightning's own: its files, its ``CheckpointIO``. A ``ckpt_path`` given to
``fit`` is loaded by Lightning when steadytrain has nothing to restore (starting from a
Lightning checkpoint), and ignored with a warning when it does.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

from steadytrain.integrations.hooks import ExitGuard
from steadytrain.integrations.lightning import ExactResume, SteadytrainCallback
from steadytrain.integrations.lightning_state import (
    RESTORED_MARK,
    dump_state,
    hand_to_lightning,
    trainer_meta,
)
from steadytrain.integrations.trainer_state import LoaderPosition, TrainerMeta
from steadytrain.run import Run

__all__ = [
    "LightningCheckpoints",
    "SteadyCheckpointing",
    "SteadyDDPStrategy",
    "SteadySingleDeviceStrategy",
]


class LightningCheckpoints:
    """The Run, the names of saved steps and the restored state of one ``fit`` (module
    docstring). ``run_dir``, ``loader``, ``checkpoint`` (a ``CheckpointerConfig`` or dict:
    ``keep_last``, ``async_mode``, ``memory``, ``remote``, ...; ``every_steps`` adds saves of
    steadytrain's own), ``checkpoint_dir`` (default ``RUN_DIR/checkpoints``), ``monitor``,
    ``config``, ``backend_timeout_s``: as ``steadytrain.Run``;
    ``tokens_per_step``: as ``SteadytrainCallback``. ``device`` comes from the strategy."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        loader: Any = None,
        checkpoint: Any = None,
        checkpoint_dir: str | None = None,
        tokens_per_step: int | None = None,
        **run_kw: Any,
    ) -> None:
        self.run_dir = os.fspath(run_dir)
        self.loader = loader
        self.checkpoint, self.checkpoint_dir = checkpoint, checkpoint_dir
        self.tokens_per_step = tokens_per_step
        self.run_kw = run_kw
        self.run: Run | None = None
        self.paths: dict[str, int] = {}  # ModelCheckpoint's path -> the step it names
        self.restored: dict[str, Any] | None = None  # Lightning's dict, once restored
        self.callback: SteadytrainCallback | None = None
        self._trainer: Any = None
        self._pending: dict[str, Any] | None = None  # the dict Lightning is saving now
        self._saved_step = -1
        self._guard: ExitGuard | None = None

    # -- open / close ----------------------------------------------------------------------
    def open(self, trainer: Any, strategy: Any) -> None:
        """Open the Run (its restore included) and hand what it restored to Lightning."""
        self.close(None)  # a second fit() in this process: the first Run is over
        self._trainer, self.restored, self.paths = trainer, None, {}
        states: dict[str, Any] = {"model": strategy.lightning_module}
        for i, optimizer in enumerate(strategy.optimizers):
            states[f"optimizer_{i}"] = optimizer
        states["lightning"] = TrainerMeta(self._meta, self._restore, self._names, self._renamed)
        exact = self._exact_resume(trainer)
        if exact is not None:
            states["loader"] = LoaderPosition(
                exact.dataset, lambda: setattr(exact, "_loaded", True)
            )
        run = Run(
            self.run_dir,
            states,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            total_steps=trainer.max_steps if trainer.max_steps > 0 else None,
            checkpoint=self.checkpoint,
            checkpoint_dir=self.checkpoint_dir,
            device=strategy.root_device.type,  # so alerts advise for the hardware
            **self.run_kw,
        )
        run.__enter__()
        self.run, self._saved_step = run, run.start_step
        # A process that leaves with this Run open (an exception that escapes Lightning's
        # hooks, SIGTERM seen only at exit) closes it as a crash, as the callbacks' Run does:
        # never the meter's clean ``interpreter_exit`` for an attempt that failed.
        self._guard = ExitGuard(self.close, "Lightning's teardown (the strategy's Run open)")
        self._guard.install()
        self._pin()
        self.callback = self._accounting(trainer)
        if exact is not None and exact not in trainer.callbacks:
            trainer.callbacks.insert(1, exact)
        if self.restored is not None:
            self.restored = hand_to_lightning(trainer, strategy, self.restored)

    def close(self, exc: BaseException | None) -> None:
        """Close the Run: on a clean end its final save and ``job_end``; else the crash."""
        run, self.run = self.run, None
        if run is None:
            return
        if self._guard is not None:
            self._guard.uninstall()
        if self.callback is not None and self.callback.run is run:
            self.callback._close(exc)  # its pending step first (no hook reached it)
        self._pending = None
        run.__exit__(None if exc is None else type(exc), exc, None)

    def _exact_resume(self, trainer: Any) -> ExactResume | None:
        if self.loader is None:
            return None
        for cb in trainer.callbacks:
            if isinstance(cb, ExactResume) and cb.loader is self.loader:
                return cb  # the user's: one ExactResume per loader notes what was trained
        return ExactResume(self.loader)

    def _accounting(self, trainer: Any) -> SteadytrainCallback:
        cb = next((c for c in trainer.callbacks if isinstance(c, SteadytrainCallback)), None)
        if cb is None:
            cb = SteadytrainCallback(self.run_dir, tokens_per_step=self.tokens_per_step)
            trainer.callbacks.insert(0, cb)  # before ModelCheckpoint, which Lightning runs last
        cb.attach(self.run)
        return cb

    # -- saving ----------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        """Lightning saves ``checkpoint`` to ``path``: save its step (or name it again)."""
        assert self.run is not None
        step = int(checkpoint.get("global_step", self._trainer.global_step))
        self.paths[os.fspath(path)] = step
        self._pin()
        if step == self._saved_step:
            return  # a second name for a step already saved (last.ckpt), or the restored one
        # A weights-only save (ModelCheckpoint(save_weights_only=True)) holds no loops or
        # callbacks: steadytrain saves the whole state, Lightning's dump of it.
        self._pending = checkpoint if "callbacks" in checkpoint else None
        try:
            pending = self.callback.pending_tokens() if self.callback is not None else 0
            self.run.save(step, tokens_seen=self.run.tokens_seen + pending)
        finally:
            self._pending = None
        self._saved_step = step

    def remove(self, path: str) -> bool:
        """``ModelCheckpoint`` no longer wants ``path``: drop the name (False: not ours)."""
        if os.fspath(path) not in self.paths:
            return False
        del self.paths[os.fspath(path)]
        self._pin()
        return True

    def _pin(self) -> None:
        if self.run is not None and self.run.checkpointer is not None:
            self.run.checkpointer.pinned_steps = frozenset(self.paths.values())

    # -- the "lightning" state -------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        """Lightning's checkpoint dict less the tensors DCP saves (the one being saved, or a
        dump of the trainer now: a memory snapshot, the final save)."""
        return trainer_meta(self._pending or dump_state(self._trainer))

    def _restore(self, meta: dict[str, Any]) -> None:
        self.restored = meta

    def _names(self) -> dict[str, Any]:
        return {"paths": dict(self.paths)}

    def _renamed(self, extra: dict[str, Any]) -> None:
        paths = extra.get("paths") or {}
        self.paths = {str(k): int(v) for k, v in paths.items()}


class SteadyCheckpointing:
    """Put before a Lightning strategy class: ``fit`` saves and restores through steadytrain
    (module docstring). Takes ``LightningCheckpoints``' arguments, the rest go to the
    strategy."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        loader: Any = None,
        checkpoint: Any = None,
        checkpoint_dir: str | None = None,
        tokens_per_step: int | None = None,
        monitor: Any = None,
        config: dict[str, Any] | None = None,
        backend_timeout_s: float | None = None,
        **strategy_kw: Any,
    ) -> None:
        super().__init__(**strategy_kw)
        self.steady = LightningCheckpoints(
            run_dir,
            loader=loader,
            checkpoint=checkpoint,
            checkpoint_dir=checkpoint_dir,
            tokens_per_step=tokens_per_step,
            monitor=monitor,
            config=config,
            backend_timeout_s=backend_timeout_s,
        )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizers exist then: the restore loads them with the weights

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.steady.restored is None  # else the restore loaded them already

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.steady.open(trainer, self)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if self.steady.run is None:  # outside fit: Lightning's own file
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "steadytrain's strategy saves through its Checkpointer, not a CheckpointIO: "
                "storage_options is not used; set checkpoint={'remote': URL, "
                "'storage_options': {...}} on the strategy instead"
            )
        self.steady.save(checkpoint, os.fspath(filepath))

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.steady.remove(os.fspath(filepath)):
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        restored = self.steady.restored
        if restored is None:  # nothing of steadytrain's: a Lightning file to start from
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        warnings.warn(
            f"steadytrain: fit(ckpt_path={os.fspath(checkpoint_path)!r}) is ignored: the run "
            f"resumed from its own newest checkpoint (step {restored.get('global_step')}) "
            f"under {self.steady.run_dir}; ckpt_path is not needed",
            RuntimeWarning,
            stacklevel=2,
        )
        return restored

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not checkpoint.get(RESTORED_MARK):  # restored by steadytrain: loaded already
            super().load_model_state_dict(checkpoint, strict=strict)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.steady.close(exception)

    def teardown(self) -> None:
        self.steady.close(None)  # the final save, before the model leaves for the CPU
        super().teardown()


class SteadyDDPStrategy(SteadyCheckpointing, DDPStrategy):
    """Lightning's ``DDPStrategy`` with steadytrain's checkpoints (``SteadyCheckpointing``)."""


class SteadySingleDeviceStrategy(SteadyCheckpointing, SingleDeviceStrategy):
    """Lightning's ``SingleDeviceStrategy`` (default ``device="cpu"``) with steadytrain's
    checkpoints (``SteadyCheckpointing``)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, device: Any = "cpu", **kw: Any):
        super().__init__(run_dir, device=device, **kw)
