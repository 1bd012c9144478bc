"""What the trainer plugins write, read back: a damaged newest checkpoint, export, best k.

One process each (no torchrun, forked from a warm process: `warm_pool.py`), the examples
as a user runs them:

- a run of 12 steps saving every 4 is SIGKILLed inside the save of step 12 (no COMMIT);
  the newest committed checkpoint, step 8, is then damaged (one byte of a shard flipped).
  Started again with no argument, the run skips both, restores step 4, finishes, and ends
  with the weights of an uninterrupted run; ``steadytrain report`` names both skipped
  checkpoints and why. Lightning (``SteadySingleDeviceStrategy``) and HF
  (``SteadytrainTrainer``) alike.
- ``steadytrain export`` reads what each wrote: Lightning's to one ``torch.save`` file
  whose ``model`` weights are the run's final ones; HF's to ``model.safetensors``, which
  ``from_pretrained`` loads into the same weights.
- Lightning's ``ModelCheckpoint(monitor=..., save_top_k=2)`` keeps its best two steps
  through steadytrain's retention: kept are exactly the best two and the newest
  ``keep_last`` (2); the steps it removed are gone, though older than neither rule keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from example_runs import EXAMPLES
from warm_pool import python

from steadytrain.testing.incidents.common import report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CLI = [sys.executable, "-m", "steadytrain.cli"]


def _example(script: str, data: str, run_dir: str, *extra: str) -> subprocess.Popen:
    """``python examples/SCRIPT ...`` as a user runs it, one process, no torchrun; forked
    from the script's warm process (``warm_pool.py``: Lightning's or transformers' imports
    once per test process, not once per run), fresh with ``STEADYTRAIN_TEST_FRESH=1``."""
    args = ["--data", data, "--run-dir", run_dir, "--steps", "12", *extra]
    cmd = python(os.path.join(EXAMPLES, script), *args, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        cmd["env"].pop(key, None)
    return subprocess.Popen(**cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _done(proc: subprocess.Popen, code: int = 0) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, out[-6000:]
    return out


def _flip_a_shard_byte(step_dir: str) -> str:
    shard = max(
        (os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".distcp")),
        key=os.path.getsize,
    )
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return shard


def _final(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "final.json")) as f:
        return json.load(f)


def _damaged_newest_falls_back(script: str, data: str, tmp) -> str:
    """The scenario of the module docstring; returns the resumed run's dir."""
    run_dir, ref = str(tmp / "run"), str(tmp / "ref")
    procs = [_example(script, data, run_dir, "--crash-in-save", "12"), _example(script, data, ref)]
    _done(procs[0], -9)  # killed inside the save of step 12
    _done(procs[1])
    ckpts = os.path.join(run_dir, "checkpoints")
    assert os.path.exists(os.path.join(ckpts, "step-00000008", "COMMIT"))
    assert not os.path.exists(os.path.join(ckpts, "step-00000012", "COMMIT"))
    _flip_a_shard_byte(os.path.join(ckpts, "step-00000008"))
    _done(_example(script, data, run_dir))  # no argument: it finds its own way back

    assert _final(run_dir) == _final(ref) and _final(ref)["step"] == 12
    rep = report(run_dir, plots=False)
    [row] = rep["restores"]
    assert (row["step"], row["tier"]) == (4, "durable"), row
    skipped = {k["path"]: k["reason"] for k in rep["restores_passed_over"]}
    assert sorted(skipped) == ["step-00000008", "step-00000012"], rep["restores_passed_over"]
    assert "no COMMIT" in skipped["step-00000012"]
    assert "checksum" in skipped["step-00000008"], skipped
    text = subprocess.run(
        [*CLI, "report", run_dir, "--no-plots"], capture_output=True, text=True, timeout=180
    ).stdout
    assert "passed over at restore" in text, text
    assert "step 8, step-00000008: " in text and "step 12, step-00000012: " in text, text
    return run_dir


def _export(src: str, to: str, out: str) -> None:
    got = subprocess.run(
        [*CLI, "export", src, "--to", to, "--out", out], capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr


def _sha256(state: dict) -> str:
    """The examples' ``weights_sha256`` of a state dict."""
    sys.path.insert(0, EXAMPLES)
    from lightning_callback import weights_sha256

    return weights_sha256(types.SimpleNamespace(state_dict=lambda: state))


def test_lightning_damaged_newest_falls_back_and_export_reads_it(dataset, tmp_path) -> None:
    import torch

    run_dir = _damaged_newest_falls_back("lightning_callback.py", dataset, tmp_path)
    out = str(tmp_path / "final.pt")
    _export(os.path.join(run_dir, "checkpoints"), "torch", out)  # the newest that verifies
    exported = torch.load(out, weights_only=False)
    assert {"model", "optimizer_0", "_steadytrain"} <= set(exported), sorted(exported)
    assert _sha256(exported["model"]) == _final(run_dir)["weights"]  # the LightningModule's keys
    lightning = exported["_steadytrain"]["ranks"][0]["states"]["lightning"]["state"]
    assert lightning["global_step"] == 12


def test_hf_damaged_newest_falls_back_and_from_pretrained_loads_the_export(
    dataset, tmp_path
) -> None:
    pytest.importorskip("safetensors")
    from transformers import LlamaForCausalLM

    run_dir = _damaged_newest_falls_back("hf_trainer_callback.py", dataset, tmp_path)
    out = str(tmp_path / "hf")
    _export(os.path.join(run_dir, "checkpoints"), "safetensors", out)
    sys.path.insert(0, EXAMPLES)
    from hf_trainer_callback import tiny_config

    tiny_config(257, 64).save_pretrained(out)  # the export holds the weights only
    model = LlamaForCausalLM.from_pretrained(out)
    assert _sha256(model.state_dict()) == _final(run_dir)["weights"]


# The validation loss ModelCheckpoint sees at steps 2, 4, ..., 12. It saves 2, 4 and 6
# (dropping 2), 10 (dropping 4); the best two are then 6 and 10, and Run's final save adds 12.
VAL_LOSS = {2: 3.0, 4: 2.0, 6: 1.0, 8: 4.0, 10: 0.5, 12: 5.0}


def test_lightning_keeps_modelcheckpoints_best_k(dataset, tmp_path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    sys.path.insert(0, EXAMPLES)
    from lightning_callback import TinyLM

    from steadytrain import TokenDataset, TokenLoader, TokenWindows
    from steadytrain.checkpoint.inspect import list_checkpoints
    from steadytrain.integrations.lightning_steady import SteadySingleDeviceStrategy

    class Scored(TinyLM):
        def validation_step(self, batch: dict, idx: int) -> None:
            self.log("val_loss", VAL_LOSS[self.trainer.global_step])

    ds = TokenDataset.open(dataset)
    loader = TokenLoader(ds, seq_len=32, global_batch=2, micro_batch=2, labels="next")
    run_dir = str(tmp_path / "run")
    strategy = SteadySingleDeviceStrategy(run_dir, loader=loader, checkpoint={"keep_last": 2})
    best = ModelCheckpoint(str(tmp_path / "mc"), monitor="val_loss", save_top_k=2, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=12,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=[best],
        default_root_dir=run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val = DataLoader(TokenWindows(ds, 32, labels="next"), batch_size=2)
    trainer.fit(Scored(ds.vocab_size), DataLoader(loader.as_dataset(), batch_size=None), val)
    loader.close()
    names = strategy.steady.paths
    assert sorted(names[p] for p in best.best_k_models) == [6, 10]
    assert names[best.last_model_path] == 10
    rows = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    kept = sorted(r["step"] for r in rows if r["state"] == "committed")
    # The best two, and the newest two (keep_last: 10 and the final save's 12); 2 and 4,
    # which ModelCheckpoint removed, are gone.
    assert kept == [6, 10, 12], rows
    assert torch.is_tensor(best.best_model_score)
