"""steadytrain's loader as a torchtitan (0.3.0) data loader.

torchtitan builds its data loader from the trainer config's ``dataloader`` field: a
``BaseDataLoader.Config`` whose ``build(dp_world_size=, dp_rank=, tokenizer=, seq_len=,
local_batch_size=, snapshot_every_n_steps=)`` constructs the loader class that owns it. Its
``CheckpointManager`` saves that loader under ``"dataloader"`` through DCP, as a ``Stateful``
(``state_dict()`` / ``load_state_dict()``). ``SteadyTitanDataLoader`` fills both contracts::

    from torchtitan_adapter import SteadyTitanDataLoader
    config.dataloader = SteadyTitanDataLoader.Config(dataset_path="s3://corpus/v1",
                                                     cache_dir="/nvme/steady-cache")

What changes against torchtitan's own ``HuggingFaceTextDataLoader``:
- the data is a pre-tokenized steadytrain dataset: torchtitan's tokenizer is not used, and
  the model's vocabulary must cover the dataset's ``vocab_size``;
- batches are ``({"input": input_ids}, labels)`` with next-token labels (``labels="next"``):
  torchtitan's loss does not shift;
- the state is the loader's handful of integers under one key, the same on every rank at a
  step boundary (where torchtitan checkpoints), so DCP keeps one copy and a job resumes on
  another data-parallel degree; torchtitan's own loader refuses that.
``global_batch`` must equal torchtitan's ``training.global_batch_size`` when it is set (it
makes the gradient-accumulation steps); unset, it is ``local_batch_size * dp_world_size``.

torchtitan 0.3.0 declares ``datasets<4.8`` (so ``fsspec<=2026.2``), which conflicts with the
fsspec that steadytrain's S3 extra locks; its data loader and checkpoint modules need only
torch, torchdata and ``tyro``. The test installs it without its declared dependencies and
checks this adapter at torchtitan's boundary (base class, ``Config.build``, a save and load
through its real ``CheckpointManager``); a full torchtitan training is not run here.

The ledger, the hang watchdog and crash/restart accounting come from ``steadytrain.Run``
like in any loop; torchtitan's ``CheckpointManager`` keeps the checkpoints, so ``titan_run``
opens a ``Run`` without a checkpointer, told the step torchtitan restored::

    with titan_run(run_dir, trainer.step, total_steps=job.training.steps) as run:
        while trainer.step < job.training.steps:
            ...                                   # torchtitan's own train_step
            run.step_done(trainer.step, tokens=global_batch * seq_len, loss=loss)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from steadytrain import Run, TokenDataset, TokenLoader

STATE_KEY = "steadytrain_loader"  # one key for all ranks: DCP stores a single copy


def titan_run(run_dir: str, restored_step: int, **options: Any) -> Run:
    """A ``steadytrain.Run`` beside torchtitan's ``CheckpointManager``: no checkpointer of
    its own (``checkpoint=False``), ``restored_step`` is the step torchtitan loaded (0 on a
    fresh start). ``options``: Run's keywords (``total_steps``, ``monitor``, ...)."""
    return Run(run_dir, {}, checkpoint=False, restored_step=restored_step, **options)


class SteadyTitanDataLoader(BaseDataLoader):
    """A ``TokenLoader`` behind torchtitan's data-loader contract."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        # dataset_path (inherited): the steadytrain dataset, a local path or a URL
        cache_dir: str | None = None  # node-local cache for remote datasets
        global_batch: int | None = None  # samples per optimizer step, all ranks
        seed: int = 0
        shuffle: str = "global"  # global, block or sequential
        num_workers: int = 0  # the loader's worker processes (0: one thread)

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,  # unused: the dataset is already tokenized
        snapshot_every_n_steps: int | None = None,  # unused: the state is O(1) at any step
    ) -> None:
        if not config.dataset_path:
            raise ValueError(
                "SteadyTitanDataLoader.Config.dataset_path is empty: set it to a steadytrain "
                "dataset (made by `steadytrain tokenize`), a local path or an s3:// URL"
            )
        self.dataset = TokenDataset.open(config.dataset_path, cache_dir=config.cache_dir)
        self.loader = TokenLoader(
            self.dataset,
            seq_len=seq_len,
            global_batch=config.global_batch or local_batch_size * dp_world_size,
            micro_batch=local_batch_size,
            rank=dp_rank,
            world_size=dp_world_size,
            seed=config.seed,
            shuffle=config.shuffle,
            num_workers=config.num_workers,
            labels="next",  # torchtitan's cross-entropy does not shift
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:  # steps, not epochs: torchtitan stops at training.steps
            batch = next(self.loader)
            yield {"input": batch["input_ids"]}, batch["labels"]

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan: an empty state (no loader in the checkpoint) is valid
            return
        self.loader.load_state_dict(json.loads(state_dict[STATE_KEY]))

    def close(self) -> None:
        self.loader.close()
        self.dataset.close()
