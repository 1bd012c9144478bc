"""Hugging Face ``Trainer`` saves and restores through steadytrain's ``Checkpointer``.

    args = TrainingArguments(output_dir="out", max_steps=N, save_steps=K,
                             per_device_train_batch_size=M, gradient_accumulation_steps=A)
    loader = TokenLoader(ds, seq_len=L, global_batch=M * A * args.world_size, micro_batch=M,
                         rank=args.process_index, world_size=args.world_size)
    trainer = SteadytrainTrainer(model, args, loader=loader, checkpoint={"keep_last": 3})
    trainer.train()                                   # resumes by itself

``SteadytrainTrainer`` is ``SteadyCheckpointsMixin`` before ``Trainer``; put the mixin before
any other ``Trainer`` subclass the same way. What it overrides, and why each:

- ``train(resume_from_checkpoint=None)``: before the Trainer's own ``train``, opens a
  ``steadytrain.Run`` over ``{"model", "optimizer", "trainer": HF's TrainerState, scheduler
  and scaler states, "loader": the TokenLoader's position}``; Run restores the newest good
  recovery point (memory snapshot, else the newest committed checkpoint that verifies, else
  an older one). The optimizer is made first, with the Trainer's public ``create_optimizer``
  (the Trainer keeps one it finds, as with ``optimizers=``), so weights and moments load in
  one restore. A restore hands the Trainer a resume directory holding only the restored
  ``trainer_state.json``: the Trainer's own code then restores its ``TrainerState``, its
  stateful callbacks and its loop counters from it, and calls the four loaders below, which
  apply what steadytrain restored instead of reading files. No ``resume_from_checkpoint`` is
  needed; ``True`` is the same; a path (an HF ``checkpoint-N`` folder) is the Trainer's own
  resume when steadytrain has nothing to restore, and is ignored with a warning when it has.
- ``_load_from_checkpoint`` (the weights: restored already), ``_load_optimizer_and_scheduler``
  (the scheduler's state, once the Trainer made the scheduler), ``_load_scaler``,
  ``_load_rng_state`` (every RNG as saved, at the point the Trainer restores them: right
  before the first step): for the resume directory only; any other path is the Trainer's.
- ``_save_checkpoint`` (called when ``save_strategy`` says so, on every rank): ``Run.save``
  instead of ``checkpoint-N`` folders: the loop pays for staging, the write and COMMIT run
  in the background; the memory tier snapshots in ``step_done`` (``checkpoint.memory``).
  ``save_total_limit`` becomes ``keep_last`` (at least 2) unless ``checkpoint`` sets it.
- ``get_train_dataloader``: with ``loader=``, a plain ``DataLoader(loader.as_dataset(),
  batch_size=None)``: the TokenLoader's micro-batches as they are, not batched, sharded or
  sampled again; ``args.ignore_data_skip`` is set, so a resume does not read and drop the
  steps already trained: the loader's own state is the position.
- ``training_step``: takes the loader's bookkeeping fields (``sample_ids``, ``doc_ids``)
  out of the batch before the model sees them; the current step's sample ids on this rank
  are ``trainer.steady.sample_ids``.

Accounting: ``SteadytrainCallback`` (the Trainer's own if given, else one added) records
into this Run (steps, saves as checkpoint blocking, evaluations in their watchdog phase);
an exception out of ``train`` closes the Run as a crash. On 3 or more DDP ranks the model
is wrapped by ``exact_ddp`` before the first backward. Not supported (refused at
construction, naming the fix): DeepSpeed, FSDP, ``model_init``, ``load_best_model_at_end``,
and a ``loader`` whose micro-batch, step, rank or world size disagree with the arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState

from steadytrain.checkpoint import state as S
from steadytrain.ddp import exact_ddp
from steadytrain.errors import ConfigError
from steadytrain.integrations.hf import SteadytrainCallback
from steadytrain.integrations.trainer_state import LoaderPosition, TrainerMeta
from steadytrain.run import Run
from steadytrain.run_support import checkpointer_config

__all__ = ["HFCheckpoints", "SteadyCheckpointsMixin", "SteadytrainTrainer"]

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
LOADER_FIELDS = ("sample_ids", "doc_ids")  # what a TokenLoader batch holds for its user


class HFCheckpoints:
    """The Run, the restored state and the resume directory of one ``train()`` (module
    docstring)."""

    def __init__(
        self,
        trainer: Any,
        run_dir: str,
        *,
        loader: Any,
        checkpoint: Any,
        checkpoint_dir: str | None,
        tokens_per_step: int | None,
        run_kw: dict[str, Any],
    ) -> None:
        self.trainer, self.run_dir, self.loader = trainer, run_dir, loader
        self.checkpoint_dir, self.run_kw = checkpoint_dir, run_kw
        self.checkpoint = _keep_last(checkpoint, trainer.args.save_total_limit)
        self.run: Run | None = None
        self.restored: dict[str, Any] | None = None
        self.resume_dir: str | None = None
        self.sample_ids: list[int] = []  # this rank's samples of the current step
        self._rng: dict[str, Any] | None = None
        self._groups: list[dict[str, Any]] | None = None  # the optimizer's, as restored
        self._saved_step = -1
        self.callback = next(
            (c for c in trainer.callback_handler.callbacks if isinstance(c, SteadytrainCallback)),
            None,
        )
        if self.callback is None:
            self.callback = SteadytrainCallback(run_dir, tokens_per_step=tokens_per_step)
            trainer.add_callback(self.callback)
        trainer.add_callback(_Hooks(self))

    # -- open / close ----------------------------------------------------------------------
    def open(self, resume_from_checkpoint: Any) -> Any:
        """Open the Run (its restore included); the path ``Trainer.train`` gets to resume
        from: the resume directory, the caller's own HF checkpoint, or None."""
        self.close(None)
        t = self.trainer
        if t.optimizer is None:
            t.create_optimizer()  # what the Trainer would make: it keeps this one
        states: dict[str, Any] = {
            "model": t.model,
            "optimizer": t.optimizer,
            "trainer": TrainerMeta(self._meta, self._restore),
        }
        if self.loader is not None:
            states["loader"] = LoaderPosition(self.loader.as_dataset())
        self.restored, self._saved_step, self._groups = None, -1, None
        run = Run(
            self.run_dir,
            states,
            rank=t.args.process_index,
            world_size=t.args.world_size,
            total_steps=t.args.max_steps if t.args.max_steps > 0 else None,
            checkpoint=self.checkpoint,
            checkpoint_dir=self.checkpoint_dir,
            device=t.args.device.type,
            **self.run_kw,
        )
        run.__enter__()
        self.run, self._saved_step = run, run.start_step
        self.callback.attach(run)
        if self.restored is None:
            return None if resume_from_checkpoint is True else resume_from_checkpoint
        if resume_from_checkpoint not in (None, True):
            warnings.warn(
                f"steadytrain: train(resume_from_checkpoint={resume_from_checkpoint!r}) is "
                f"ignored: the run resumed from its own newest checkpoint (step "
                f"{run.start_step}) under {self.run_dir}; no argument is needed",
                RuntimeWarning,
                stacklevel=3,
            )
        self._rng = S.rng_state()  # as restored; applied again where the Trainer does it
        # The optimizer's hyperparameters as restored (lr above all): the Trainer makes its
        # LR scheduler after this restore, and a scheduler's constructor sets every group's
        # lr (to initial_lr x its factor at step 0); applied again after it (``apply``).
        self._groups = [
            {k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups
        ]
        self.resume_dir = tempfile.mkdtemp(prefix="steadytrain-hf-resume-")
        with open(os.path.join(self.resume_dir, TRAINER_STATE_NAME), "w") as f:
            json.dump(self.restored["trainer_state"], f)
        return self.resume_dir

    def close(self, exc: BaseException | None) -> None:
        run, self.run = self.run, None
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
            self.resume_dir = None
        if run is None:
            return
        if self.callback.run is run:
            self.callback._close(exc)  # its pending step first (no hook reached it)
        run.__exit__(None if exc is None else type(exc), exc, None)

    # -- saving and the restored state -----------------------------------------------------
    def save(self) -> None:
        """The Trainer's save of this step (every rank)."""
        assert self.run is not None
        t = self.trainer
        if t.hp_search_backend is None:
            t.store_flos()  # as Trainer._save_checkpoint: total_flos in the saved state
        step = int(t.state.global_step)
        if step == self._saved_step:
            return  # saved already (an evaluation's save after the step's own)
        self.run.save(step, tokens_seen=self.run.tokens_seen + self.callback.pending_tokens())
        self._saved_step = step

    def owns(self, path: Any) -> bool:
        """``path`` is this Run's resume directory (not an HF checkpoint of the caller's)."""
        return self.resume_dir is not None and path is not None and str(path) == self.resume_dir

    def apply(self, what: str) -> None:
        """Apply the restored ``"scheduler"``, ``"scaler"`` or ``"rng"`` state."""
        t, got = self.trainer, self.restored or {}
        if what == "scheduler":
            # as the Trainer's own resume: the optimizer's saved groups over what the new
            # scheduler set, then the scheduler's state (which leaves the groups alone)
            for group, saved in zip(t.optimizer.param_groups, self._groups or [], strict=False):
                group.update(saved)
            if got.get("scheduler") is not None and t.lr_scheduler:
                t.lr_scheduler.load_state_dict(got["scheduler"])
        elif what == "scaler" and got.get("scaler") is not None:
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                scaler.load_state_dict(got["scaler"])
        elif what == "rng" and self._rng is not None:
            S.set_rng_state(self._rng)

    def _meta(self) -> dict[str, Any]:
        """The Trainer's own state now: TrainerState (its stateful callbacks' states taken
        as ``Trainer._save_checkpoint`` takes them), scheduler, scaler."""
        t = self.trainer
        state = dataclasses.asdict(t.state)
        live = [
            c for c in t.callback_handler.callbacks + [t.control] if isinstance(c, ExportableState)
        ]
        state["stateful_callbacks"] = TrainerState(stateful_callbacks=live).stateful_callbacks
        scaler = getattr(t.accelerator, "scaler", None)
        return {
            "trainer_state": state,
            "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }

    def _restore(self, meta: dict[str, Any]) -> None:
        if not isinstance(meta.get("trainer_state"), dict):
            raise ConfigError("the checkpoint's HF Trainer state has no trainer_state")
        self.restored = meta

    def take_batch(self, inputs: Any) -> Any:
        """The batch without the loader's bookkeeping fields (their sample ids noted)."""
        if not isinstance(inputs, dict) or "sample_ids" not in inputs:
            return inputs
        self.sample_ids += [int(i) for i in inputs["sample_ids"].tolist()]
        return {k: v for k, v in inputs.items() if k not in LOADER_FIELDS}


class _Hooks(TrainerCallback):
    """The loader's trained position, the step's sample ids, ``exact_ddp``."""

    def __init__(self, steady: HFCheckpoints) -> None:
        self.steady = steady

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.steady.trainer.model_wrapped
        if isinstance(model, DistributedDataParallel):
            exact_ddp(model)  # the first step after a restart reduces in the same layout

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steady.sample_ids = []

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._consumed()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._consumed()

    def _consumed(self) -> None:
        if self.steady.loader is not None:  # one micro-batch trained on
            self.steady.loader.as_dataset().consumed()


def _keep_last(checkpoint: Any, save_total_limit: int | None) -> Any:
    """``checkpoint`` with ``keep_last`` from HF's ``save_total_limit`` when it sets none
    (at least 2: a damaged newest checkpoint needs an older one to fall back to)."""
    cfg = checkpointer_config(checkpoint)
    given = checkpoint.get("keep_last") if isinstance(checkpoint, dict) else None
    if save_total_limit and given is None and not hasattr(checkpoint, "keep_last"):
        cfg.keep_last = max(2, int(save_total_limit))
    return cfg


class SteadyCheckpointsMixin:
    """Put before ``Trainer`` (or a subclass of it): checkpoints through steadytrain (module
    docstring). ``run_dir`` (default ``OUTPUT_DIR/steadytrain``), ``loader`` (a
    ``TokenLoader``: the training data), ``checkpoint`` (a ``CheckpointerConfig`` or a dict
    of its keys), ``checkpoint_dir``, ``monitor``, ``config``, ``backend_timeout_s``: as
    ``steadytrain.Run``; ``tokens_per_step``: as ``SteadytrainCallback`` (with ``loader``:
    its global batch times its sequence length). The rest go to the Trainer."""

    def __init__(
        self,
        *args: Any,
        run_dir: str | os.PathLike[str] | None = None,
        loader: Any = None,
        checkpoint: Any = None,
        checkpoint_dir: str | None = None,
        tokens_per_step: int | None = None,
        monitor: Any = None,
        config: dict[str, Any] | None = None,
        backend_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        if loader is not None and kwargs.get("train_dataset") is None:
            kwargs["train_dataset"] = loader.as_dataset()  # what the Trainer checks for
        super().__init__(*args, **kwargs)
        _check(self, loader)
        if loader is not None:
            self.args.ignore_data_skip = True  # the loader's state is the position
            if tokens_per_step is None:
                tokens_per_step = loader.global_batch * loader.seq_len
        self.steady = HFCheckpoints(
            self,
            os.fspath(run_dir) if run_dir else os.path.join(self.args.output_dir, "steadytrain"),
            loader=loader,
            checkpoint=checkpoint,
            checkpoint_dir=checkpoint_dir,
            tokens_per_step=tokens_per_step,
            run_kw={"monitor": monitor, "config": config, "backend_timeout_s": backend_timeout_s},
        )

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
        path = self.steady.open(resume_from_checkpoint)
        try:
            out = super().train(resume_from_checkpoint=path, trial=trial, **kwargs)
        except BaseException as exc:
            self.steady.close(exc)
            raise
        self.steady.close(None)
        return out

    def get_train_dataloader(self) -> Any:
        if self.steady.loader is None:
            return super().get_train_dataloader()
        return DataLoader(self.steady.loader.as_dataset(), batch_size=None, num_workers=0)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        return super().training_step(model, self.steady.take_batch(inputs), num_items_in_batch)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.steady.run is None:
            return super()._save_checkpoint(model, trial)
        self.steady.save()

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if not self.steady.owns(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if not self.steady.owns(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.steady.apply("scheduler")

    def _load_scaler(self, checkpoint: Any) -> None:
        if not self.steady.owns(checkpoint):
            return super()._load_scaler(checkpoint)
        self.steady.apply("scaler")

    def _load_rng_state(self, checkpoint: Any) -> None:
        if not self.steady.owns(checkpoint):
            return super()._load_rng_state(checkpoint)
        self.steady.apply("rng")


class SteadytrainTrainer(SteadyCheckpointsMixin, Trainer):
    """Hugging Face ``Trainer`` with steadytrain's checkpoints (``SteadyCheckpointsMixin``)."""


def _check(trainer: Any, loader: Any) -> None:
    """Refuse, before training, what the mixin cannot carry, naming the fix."""
    args = trainer.args
    fix = "use Trainer's own checkpointing with steadytrain.integrations.hf.SteadytrainCallback"
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ConfigError(f"SteadytrainTrainer does not save DeepSpeed or FSDP models; {fix}")
    if trainer.model_init is not None:
        raise ConfigError(f"SteadytrainTrainer needs a model, not model_init; {fix}")
    if args.load_best_model_at_end:
        raise ConfigError(
            "load_best_model_at_end needs the Trainer's checkpoint-N folders, which "
            f"SteadytrainTrainer does not write; set it False (export the best step with "
            f"`steadytrain export`), or {fix}"
        )
    if loader is None:
        return
    want = {
        "per_device_train_batch_size": loader.micro_batch,
        "gradient_accumulation_steps": loader.micro_per_step,
        "world_size": loader.world_size,
        "process_index": loader.rank,
    }
    for name, value in want.items():
        if getattr(args, name) != value:
            raise ConfigError(
                f"TrainingArguments.{name} = {getattr(args, name)} but the TokenLoader makes "
                f"it {value}: a Trainer step must be the loader's step (micro_batch = "
                "per_device_train_batch_size, micro_per_step = gradient_accumulation_steps, "
                "rank = process_index, world_size = world_size); build the loader from the "
                "arguments"
            )
    if args.max_steps <= 0:
        raise ConfigError("a TokenLoader's stream has no epochs: set TrainingArguments.max_steps")
