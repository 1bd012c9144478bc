"""``SteadytrainCallback``: steadytrain's ledger, hang watchdog and report inside Hugging Face
``Trainer``, whose own checkpointing and ``resume_from_checkpoint`` stay as they are. Given
a causal LM ``model`` (this recipe runs as written in tests/integrations/test_hf_recipe.py,
and is the one in docs/training.md)::

    import os
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
    from steadytrain import TokenDataset, TokenWindows
    from steadytrain.integrations.hf import SteadytrainCallback

    args = TrainingArguments(output_dir="out", max_steps=20, save_steps=10,
                             per_device_train_batch_size=8, logging_steps=1)
    # Samples, not the TokenLoader's micro-batches: the Trainer batches, shuffles, shards
    # and resumes them with its own sampler (labels = input_ids: the model shifts).
    data = TokenWindows(TokenDataset.open("my-dataset"), seq_len=64)
    steady = SteadytrainCallback(tokens_per_step=8 * 64 * args.world_size)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[steady])
    os.makedirs(args.output_dir, exist_ok=True)  # every rank looks for its newest checkpoint
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

Then ``steadytrain report OUTPUT_DIR/steadytrain`` (or the ``run_dir`` given) shows the
goodput breakdown, crashes, restart gaps and the steps of every attempt. A ``TokenLoader``'s
``as_dataset()`` is refused at ``on_train_begin`` with that fix: its items are micro-batches,
which the Trainer would batch again.

How the Trainer's hooks map onto ``steadytrain.Run`` (``run.py``):

- ``on_train_begin`` opens a ``Run`` on every rank (rank and world size from the
  ``TrainingArguments``) with ``TrainerSaves`` as its checkpoint: Run saves nothing, its
  ``start_step`` is the Trainer's restored ``global_step``. The Trainer loaded its
  checkpoint before this hook, so the load is booked as start-up (the Restores table says
  "in start-up").
- a step's data wait is the time from the end of the previous step's hooks (log, save,
  evaluate) to ``on_step_begin`` (the Trainer fetches the step's batches there); its
  compute is ``on_step_begin`` to ``on_step_end``; a save's time (``on_step_end`` to
  ``on_save``) is its ``checkpoint_block_s`` and a checkpoint record in the ledger. Every
  interval is timed on ``Run.clock``, which stops inside the ``"eval"`` phase: an
  evaluation is the ledger's ``eval`` bucket, never the next step's data wait nor, when it
  falls on a save step, the save's blocking.
- the step is reported (``Run.step_done``: the ledger record, the watchdog's beat) at
  ``on_step_end``, or, when the Trainer logs or saves at that step, once ``on_log`` brought
  the loss and ``on_save`` the save's time.
- evaluation and saving run under declared watchdog phases, which hold every rank of the
  job (docs/monitoring.md, "Hang watchdog"): the Trainer evaluates and saves after
  ``on_step_end`` (``eval_strategy``/``save_strategy="steps"``) or after ``on_epoch_end``
  (``"epoch"``: ``DefaultFlowCallback`` sets the flags there), in that order, so a
  ``"eval"`` phase opens in whichever of the two hooks finds ``control.should_evaluate``
  and ends at ``on_evaluate``; a ``"checkpoint"`` phase then (or at once, with no
  evaluation) covers the save until ``on_save``. Any phase still open ends at the next
  step or at the end of training.
- ``on_train_end`` closes the Run: ``job_end`` "finished".
- a crash: the Trainer calls no callback when ``train()`` raises, so ``ExitGuard``
  (``hooks.py``) closes the Run from ``sys.excepthook`` (the exception is the reason),
  from ``atexit`` after SIGTERM (``signal: SIGTERM``) or after any other exit while
  training. The report lists each as a crash; a hang is the watchdog's (exit 124).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from steadytrain.data.read.faces import TokenIterableDataset
from steadytrain.errors import ConfigError
from steadytrain.integrations.hooks import CallbackState, ExitGuard, TrainerSaves
from steadytrain.run import Run

__all__ = ["SteadytrainCallback"]

# The Trainer's checkpoint folders: ``OUTPUT_DIR/checkpoint-STEP`` (transformers'
# trainer_utils.PREFIX_CHECKPOINT_DIR).
CHECKPOINT_PREFIX = "checkpoint"


class SteadytrainCallback(CallbackState, TrainerCallback):
    """Records a ``Trainer`` run in steadytrain's ledger (module docstring).

    ``run_dir``: where the ledger goes (default ``OUTPUT_DIR/steadytrain``).
    ``tokens_per_step``: tokens of one optimizer step over all ranks (batch x sequence
    length x ranks x accumulation); if None, the growth of the Trainer's
    ``num_input_tokens_seen`` (``include_num_input_tokens_seen=True``), else 0.
    ``monitor``, ``config``, ``device``, ``backend_timeout_s``: as ``steadytrain.Run``.
    """

    def _init_trainer_state(self) -> None:
        self._ready = self._begin = self._now()
        self._tokens_seen = 0

    # -- open / close ----------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:  # a second train() in this process: the first one ended
            self._close(None)
        if not self._take_owner_run():  # SteadytrainTrainer feeds its loader itself
            _check_train_data(kwargs.get("train_dataloader"))
            step = int(state.global_step)
            path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{step}") if step else ""
            self._saves = TrainerSaves(step, path)
            run_dir = self.run_dir or os.path.join(args.output_dir, "steadytrain")
            self.run = Run(
                run_dir,
                {},
                rank=args.process_index,
                world_size=args.world_size,
                total_steps=int(state.max_steps) or None,
                checkpoint=self._saves,
                **self._run_kw,
            )
            self.run.__enter__()
            self._guard = ExitGuard(self._close, "Trainer.train() ended (on_train_end)")
            self._guard.install()
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._pending = None
        self._ready = self._now()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(None)

    def _close(self, exc: BaseException | None) -> None:
        run = self.run
        if run is None:
            return
        self._end_phase()
        try:
            self._flush()  # a pending step finished its update (a crash in its save too)
        except BaseException as e:  # recording it failed: still close the Run, as a crash
            exc = exc or e
        self.run = None
        self._release(run, exc)

    # -- steps -----------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        self._end_phase()
        self._flush()
        self._begin = self._now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        now = self._now()
        self._pending = {
            "step": int(state.global_step),
            "tokens": self._step_tokens(state),
            "data_wait_s": max(0.0, self._begin - self._ready),
            "compute_s": now - self._begin,
            "loss": None,
            "wait_log": bool(control.should_log),  # DefaultFlowCallback ran first: known
            "wait_save": bool(control.should_save),
            "end": now,
        }
        self._open_phase(control)
        self._maybe_flush()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:  # eval/save_strategy="epoch": the flags are set only now
            self._open_phase(control)

    def _open_phase(self, control: Any) -> None:
        """The evaluation's or else the save's declared phase, when the Trainer is about
        to run one (its flags, set by DefaultFlowCallback before this callback's hook)."""
        if control.should_evaluate:
            self._enter("eval")
        elif control.should_save:
            self._enter("checkpoint")

    def _enter(self, name: str) -> None:
        self._end_phase()
        self._phase = self.run.phase(name)
        self._phase.__enter__()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        p = self._pending
        if p is None or p["step"] != state.global_step:
            return
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)):
            p["loss"] = float(loss)
        p["wait_log"] = False
        self._maybe_flush()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_phase()  # the save is over, whichever hook opened its phase
        p = self._pending
        if self.run is None or p is None or p["step"] != state.global_step:
            return
        if self._saves is not None:  # the Trainer's own save (else Run.save timed it)
            path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
            self._saves.saved(state.global_step, self._now() - p["end"], path)
        p["wait_save"] = False
        self._maybe_flush()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_phase()  # the evaluation is over
        if self.run is not None and control.should_save:  # the save that follows it
            self._enter("checkpoint")

    def _maybe_flush(self) -> None:
        p = self._pending
        if p is not None and not p["wait_log"] and not p["wait_save"]:
            self._flush()

    def _flush(self) -> None:
        """Report the pending step (``Run.step_done``): the ledger record, the beat."""
        p, self._pending = self._pending, None
        if p is None or self.run is None:
            return
        self.run.step_done(
            p["step"],
            tokens=p["tokens"],
            loss=p["loss"],
            data_wait_s=p["data_wait_s"],
            compute_s=p["compute_s"],
        )
        self._ready = self._now()

    def _end_phase(self) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def _step_tokens(self, state: Any) -> int:
        if self.tokens_per_step is not None:
            return int(self.tokens_per_step)
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        tokens, self._tokens_seen = max(0, seen - self._tokens_seen), seen
        return tokens


def _check_train_data(dataloader: Any) -> None:
    """Refuse a ``TokenLoader``'s ``as_dataset()`` as the Trainer's data, naming the fix: the
    Trainer would batch its micro-batches again and fail deep in the model."""
    dataset = getattr(dataloader, "dataset", None)
    inner = getattr(dataset, "dataset", None)  # accelerate's IterableDatasetShard wraps it
    if isinstance(dataset, TokenIterableDataset) or isinstance(inner, TokenIterableDataset):
        raise ConfigError(
            "the Trainer's train_dataset is a TokenLoader's as_dataset(), whose items are "
            "micro-batches: the Trainer would batch them again (input_ids of shape [batch, "
            "micro_batch, seq_len]). Give it the samples: train_dataset=TokenWindows("
            "TokenDataset.open(path), seq_len=...) (docs/training.md, HF Trainer)"
        )
