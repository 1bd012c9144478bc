"""``ExactResume(loader)``: a Lightning run resumed from its checkpoint trains on the samples,
and reduces the gradients, of an uninterrupted run, bit for bit.

    loader = TokenLoader(ds, seq_len=L, global_batch=G, micro_batch=M,
                         rank=trainer_rank, world_size=world)
    trainer = L.Trainer(max_steps=N, accumulate_grad_batches=loader.micro_per_step,
                        callbacks=[ModelCheckpoint(...), ExactResume(loader)])
    trainer.fit(model, DataLoader(loader.as_dataset(), batch_size=None), ckpt_path=last)

The data (issue 40): Lightning fetches ahead of the batch it trains (2.6's
``_PrefetchDataFetcher``: one batch, for a dataset without a length), so a loader state read
when it saves at step N is one micro-batch past the last one the model trained on. A
``StatefulDataLoader`` saved in Lightning's loop state resumes there: with one micro-batch
per step, the resumed run's step N+1 trains on the uninterrupted run's step-N+2 samples
(checked with Lightning 2.6), and with more the state is mid-step and is refused on any
other rank. Here the
loader's dataset face notes the loader's position as it hands out each micro-batch
(``TokenIterableDataset``), ``on_train_batch_end`` reports the oldest one trained (it runs
before ``ModelCheckpoint``'s, which Lightning orders last), and this callback's
``state_dict`` -- saved in Lightning's checkpoint under the callback -- is the position after
the last micro-batch trained on. ``load_state_dict`` loads it into the loader before
Lightning starts fetching. Noting positions as batches are handed out, rather than
subtracting an assumed depth, keeps it right for any fetch-ahead depth. The training
DataLoader must be a plain one: Lightning saves nothing of it, so only this state resumes
the loader (a stateful one's own state, one batch ahead, would be loaded after this one:
warned at ``on_train_start``). Saves at step boundaries (``ModelCheckpoint``'s
``every_n_train_steps``) load on any rank and world size; ``accumulate_grad_batches`` must
be ``loader.micro_per_step`` for Lightning's steps to be the loader's (warned otherwise).

The gradients: on 3 or more ranks DDP's first step after a restart is reduced in another
bucket layout than the uninterrupted run used; ``on_train_start`` applies
``steadytrain.exact_ddp`` to the strategy's DDP module, before the first backward.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback
from torch.nn.parallel import DistributedDataParallel

from steadytrain.ddp import exact_ddp

__all__ = ["ExactResume"]


class ExactResume(Callback):
    """Keeps ``loader``'s position as of the last micro-batch trained on in Lightning's
    checkpoints, and DDP's gradient layout fixed (module docstring)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.dataset = loader.as_dataset()  # the one face, the same the DataLoader iterates
        self._warned = False
        self._loaded = False  # a position came from Lightning's checkpoint

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, DistributedDataParallel):
            exact_ddp(model)
        if trainer.global_step and not self._loaded:
            _warn(
                f"Lightning resumed at step {trainer.global_step} from a checkpoint that holds "
                "no loader position of this callback (saved without it?): the loader starts "
                "where it stands, not where that run stopped"
            )
        if trainer.accumulate_grad_batches != self.loader.micro_per_step:
            _warn(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} but the loader "
                f"makes a step of {self.loader.micro_per_step} micro-batches: Lightning's saves "
                "fall inside the loader's steps; set accumulate_grad_batches="
                f"{self.loader.micro_per_step}"
            )
        if hasattr(trainer.train_dataloader, "state_dict"):
            _warn(
                "the training DataLoader saves a state of its own, which Lightning loads after "
                "this callback's, one batch ahead of the model; use "
                "DataLoader(loader.as_dataset(), batch_size=None)"
            )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.dataset.consumed() and not self._warned:
            self._warned = True
            _warn(
                "the batch Lightning trained on did not come from loader.as_dataset(); the "
                "checkpoints hold no position for it. Train on "
                "DataLoader(loader.as_dataset(), batch_size=None)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.dataset.consumed_state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict["loader"])
        self._loaded = True


def _warn(what: str) -> None:
    warnings.warn(f"steadytrain ExactResume: {what}", RuntimeWarning, stacklevel=3)
