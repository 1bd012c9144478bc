"""Lightning's checkpoint dict, taken from and handed back to its own checkpoint connector.

The steadytrain strategy (``lightning_steady.py``) saves what Lightning would write to a
``.ckpt`` file and restores it through Lightning's own restore code, so loops, callbacks,
schedulers, precision state and every ``on_load_checkpoint`` hook behave as with Lightning's
checkpoints. Two places need Lightning's ``_CheckpointConnector`` (``trainer.
_checkpoint_connector``, private), and only these two, kept here:

- ``dump_state``: ``dump_checkpoint(weights_only=False)``, the dict ``trainer.
  save_checkpoint`` would save, for saves Lightning did not ask for (a memory-tier snapshot,
  the final save). ``trainer.save_checkpoint`` itself would do it too, but also runs a
  barrier on the training group and calls ``save_checkpoint`` back.
- ``hand_to_lightning``: after steadytrain restored a checkpoint at ``setup``, the dict goes
  into ``_loaded_checkpoint``, the field ``fit(ckpt_path=...)`` fills from the file, which
  Lightning restores from right after ``setup`` (the strategy's
  ``restore_checkpoint_after_setup``). Without it an automatic resume would need a
  ``ckpt_path`` argument (``fit(ckpt_path=None)`` loads nothing: Lightning's own SLURM
  auto-resume is the same kind of rule, hard-wired to ``hpc_ckpt_*.ckpt`` files).

Both were checked against Lightning 2.5 and 2.6 (the ``integrations`` extra's range); a
Lightning without them gets a ``CheckpointError`` that says so, before any training.
"""

from __future__ import annotations

from typing import Any

from steadytrain.errors import CheckpointError

__all__ = ["RESTORED_MARK", "TENSOR_KEYS", "dump_state", "hand_to_lightning", "trainer_meta"]

# In the dict handed to Lightning: restored by steadytrain (the strategy's
# load_model_state_dict then leaves the already loaded weights alone).
RESTORED_MARK = "steadytrain_restored"
# Lightning's keys whose tensors DCP saves from the live module and optimizers.
TENSOR_KEYS = ("state_dict", "optimizer_states")


def _connector(trainer: Any, attr: str) -> Any:
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or not hasattr(connector, attr):
        import lightning

        raise CheckpointError(
            f"Lightning {lightning.__version__} has no trainer._checkpoint_connector.{attr}, "
            "which steadytrain's strategy uses to save and restore Lightning's state; use "
            "Lightning 2.5 or 2.6 (steadytrain[integrations]), or Lightning's own "
            "checkpointing with steadytrain.integrations.lightning.SteadytrainCallback"
        )
    return connector


def dump_state(trainer: Any) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would save now (weights and optimizers too)."""
    return _connector(trainer, "dump_checkpoint").dump_checkpoint(weights_only=False)


def trainer_meta(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` without the tensors DCP saves from the live objects."""
    return {k: v for k, v in checkpoint.items() if k not in TENSOR_KEYS and k != RESTORED_MARK}


def hand_to_lightning(trainer: Any, strategy: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Give Lightning the restored ``meta`` to restore loops, callbacks, schedulers from.
    The weights and moments are already in place; the dict carries them too (as the live
    objects' state dicts) for ``on_load_checkpoint`` hooks that read them."""
    connector = _connector(trainer, "_loaded_checkpoint")
    full = dict(meta)
    full["state_dict"] = strategy.lightning_module.state_dict()
    full["optimizer_states"] = [o.state_dict() for o in strategy.optimizers]
    full[RESTORED_MARK] = True
    connector._loaded_checkpoint = full
    return full
