"""``SteadytrainCallback``: steadytrain's ledger, hang watchdog and report inside a Lightning
``Trainer``, whose own ``ModelCheckpoint`` and ``fit(ckpt_path=...)`` stay as they are.

    trainer = L.Trainer(max_steps=N, callbacks=[ModelCheckpoint(...),
                                                SteadytrainCallback("runs/r1")])
    trainer.fit(model, loader, ckpt_path=last_or_none)

How Lightning's hooks map onto ``steadytrain.Run`` (``run.py``):

- ``on_train_start`` opens a ``Run`` on every rank (``trainer.global_rank`` /
  ``world_size``) with ``TrainerSaves`` as its checkpoint (``hooks.py``): Run saves nothing,
  its ``start_step`` is Lightning's restored ``global_step``, whose load (before this hook)
  is booked as start-up (the Restores table says "in start-up").
- a step is the micro-batches between two ``global_step`` increments: data wait is the time
  before each ``on_train_batch_start`` since the previous hook, compute is
  ``on_train_batch_start`` to ``on_train_batch_end`` (every interval on ``Run.clock``,
  which stops inside the evaluation); the loss is the ``training_step``'s (its last
  micro-batch's: ``outputs["loss"]`` times ``accumulate_grad_batches``, which automatic
  optimization divided it by).
- a validation (``on_validation_start`` to ``on_validation_end``, inside ``fit``; not the
  sanity check, which runs before ``on_train_start``) runs under the declared watchdog
  phase ``"eval"``, which holds every rank of the job (docs/monitoring.md, "Hang
  watchdog"), and is the ledger's ``eval`` bucket, never a data wait or a save's blocking
  (a ``ModelCheckpoint`` with ``every_n_train_steps`` saves before it, and that save's time
  runs across it); a save after it (``ModelCheckpoint`` saves in its own
  ``on_validation_end``, which Lightning calls after every other callback's) opens its own
  phase;
- a save (``on_save_checkpoint``, called as Lightning starts writing) runs under the
  declared phase ``"checkpoint"``; Lightning has no hook after the write, so its time runs
  to the next ``on_train_batch_start`` (the next batch's fetch included) and is the step's
  ``checkpoint_block_s`` and a checkpoint record. The step is therefore reported (ledger
  record, watchdog beat) at the next ``on_train_batch_start`` or ``on_train_end``.
- ``on_train_end`` closes the Run ("finished"); ``on_exception`` closes it as a crash with
  the exception (Lightning's ``SIGTERMException`` as ``signal: SIGTERM``); ``ExitGuard``
  covers an exit no hook sees. A failure between ``setup("fit")`` and ``on_train_start``
  (the module's ``setup``, the sanity check) has no Run to close: ``on_exception`` records
  the attempt and the crash (``hooks.record_failed_start``: rank 0, no collective), and
  on_train_start never follows it, so nothing is counted twice.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback

from steadytrain.integrations.hooks import (
    CallbackState,
    ExitGuard,
    TrainerSaves,
    record_failed_start,
)
from steadytrain.integrations.lightning_exact import ExactResume
from steadytrain.run import Run
from steadytrain.run_support import Terminated

__all__ = ["ExactResume", "SteadytrainCallback"]


class SteadytrainCallback(CallbackState, Callback):
    """Records a Lightning run in steadytrain's ledger (module docstring).

    ``run_dir``: where the ledger goes (default ``trainer.default_root_dir/steadytrain``).
    ``tokens_per_step``: tokens of one optimizer step over all ranks; if None, the size of
    each micro-batch's ``input_ids`` (or the batch, if a tensor) times the world size.
    ``monitor``, ``config``, ``device``, ``backend_timeout_s``: as ``steadytrain.Run``.
    """

    def _init_trainer_state(self) -> None:
        self._save_t: float | None = None
        self._starting = False  # between setup("fit") and on_train_start
        self._eval: Any = None  # the open "eval" phase (a save's is CallbackState._phase)
        self._reset_step(0)

    def _reset_step(self, step: int) -> None:
        self._step, self._wait, self._compute, self._tokens = step, 0.0, 0.0, 0
        self._ready = self._begin = self._now()

    # -- open / close ----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._starting = False
        if self.run is not None:
            self._close(None)
        step = int(trainer.global_step)
        if not self._take_owner_run():
            self._saves = TrainerSaves(step, str(trainer.ckpt_path or "") if step else "")
            self.run = Run(
                self._run_dir(trainer),
                {},
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                total_steps=trainer.max_steps if trainer.max_steps > 0 else None,
                checkpoint=self._saves,
                **self._run_kw,
            )
            self.run.__enter__()
            self._guard = ExitGuard(self._close, "Trainer.fit() ended (on_train_end)")
            self._guard.install()
        self._pending, self._save_t = None, None
        self._reset_step(step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if type(exception).__name__ == "SIGTERMException":  # Lightning's, after SIGTERM
            exception = Terminated(signal.SIGTERM)
        # Failed in setup or the sanity check, with no Run yet. An owner's Run (the steadytrain
        # strategy's, open from its setup) records the crash itself: not a second attempt.
        if self.run is None and self._starting and self._owner_run is None:
            self._starting = False
            record_failed_start(
                self._run_dir(trainer), trainer.global_rank, trainer.world_size, exception,
                self._run_kw,
            )  # fmt: skip
        self._close(exception)

    def _run_dir(self, trainer: Any) -> str:
        return self.run_dir or os.path.join(trainer.default_root_dir, "steadytrain")

    def _close(self, exc: BaseException | None) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if exc is not None:
            self._save_t = None  # a save cut short is no checkpoint; its step did finish
        try:
            self._flush(run)
            self._end_phase()
            self.on_validation_end(None, None)  # a validation cut short ends its phase too
        except BaseException as e:  # recording it failed: still close the Run, as a crash
            exc = exc or e
        # (with self.run already None, nothing else would close it: the meter's own exit
        # hook would end the attempt as a clean "interpreter_exit")
        self._release(run, exc)

    # -- steps -----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if self.run is None:
            return
        saving = self.run.pending_block_s  # Run.save()s since the step ended: not data wait
        self._flush(self.run)
        now = self._now()
        self._wait += max(0.0, now - self._ready - saving)
        self._begin = now

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.run is None:
            return
        now = self._now()
        self._compute += now - self._begin
        self._ready = now
        self._tokens += self._batch_tokens(batch, trainer.world_size)
        if trainer.global_step <= self._step:
            return  # a micro-batch of gradient accumulation: the step goes on
        self._pending = {
            "step": int(trainer.global_step),
            "tokens": self._tokens if self.tokens_per_step is None else self.tokens_per_step,
            "data_wait_s": self._wait,
            "compute_s": self._compute,
            "loss": _step_loss(outputs, trainer, pl_module),
        }
        self._reset_step(int(trainer.global_step))
        self._ready = now

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # An owner's Run is open from the strategy's setup: the sanity check is inside it.
        run = self.run or (self._owner_run if trainer.sanity_checking else None)
        if run is not None and self._eval is None:
            self._eval = run.phase("eval")
            self._eval.__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        phase, self._eval = self._eval, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if self.run is None or self._pending is None or self._saves is None:
            return  # not a save after a step, or one Run.save times: nothing to book
        self._save_t = self._now()
        if self._phase is None:
            self._phase = self.run.phase("checkpoint")
            self._phase.__enter__()

    def _flush(self, run: Run) -> None:
        """Report the pending step (``Run.step_done``), with its save if there was one."""
        p, self._pending = self._pending, None
        if p is None:
            return
        if self._save_t is not None:
            block = self._now(run) - self._save_t
            self._save_t = None
            self._saves.saved(p["step"], block, self._saved_path())
            self._end_phase()
            self._ready = self._now(run)  # the next step's wait starts after the save
        run.step_done(
            p["step"],
            tokens=p["tokens"],
            loss=p["loss"],
            data_wait_s=p["data_wait_s"],
            compute_s=p["compute_s"],
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer_ckpt_cb = trainer.checkpoint_callback  # where a save's path is read
        # A failure from here to on_train_start has no Run to record it: on_exception does.
        self._starting = stage == "fit" and self.run is None

    _trainer_ckpt_cb: Any = None

    def _saved_path(self) -> str:
        """The file ``ModelCheckpoint`` just wrote: its newest (``monitor=None``) or best
        checkpoint, else ``last.ckpt``; "" without one."""
        cb = self._trainer_ckpt_cb
        newest = getattr(cb, "best_model_path", "") if getattr(cb, "monitor", 1) is None else ""
        return str(newest or getattr(cb, "last_model_path", "") or "")

    def _end_phase(self) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    @staticmethod
    def _batch_tokens(batch: Any, world: int) -> int:
        ids = batch.get("input_ids") if isinstance(batch, dict) else batch
        if isinstance(ids, (list, tuple)) and ids:
            ids = ids[0]
        return int(ids.numel()) * int(world) if hasattr(ids, "numel") else 0


def _step_loss(outputs: Any, trainer: Any, pl_module: Any) -> Any:
    """The step's loss as ``training_step`` returned it (and as ``self.log`` logs it): its
    last micro-batch's. Lightning's automatic optimization hands ``on_train_batch_end`` that
    loss divided by ``accumulate_grad_batches`` (what it backpropagates), so it is scaled
    back; manual optimization passes it through unscaled."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:
        return None
    loss = loss.detach() if hasattr(loss, "detach") else loss
    n = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if n > 1 and getattr(pl_module, "automatic_optimization", True):
        loss = loss * n
    return loss
