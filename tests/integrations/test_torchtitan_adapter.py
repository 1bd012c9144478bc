"""examples/torchtitan_adapter.py at torchtitan 0.3.0's boundary.

torchtitan does not train here (see the adapter's docstring: it is installed without its
declared dependencies), so the adapter is checked against the real torchtitan code it meets:
its ``BaseDataLoader`` base class and ``Stateful`` protocol, construction through
``Config.build`` with the trainer's arguments, and a save and load through torchtitan's own
``CheckpointManager`` (DCP) on 2 gloo ranks, resumed on 2 ranks and on 1: the steps after the
checkpoint see exactly the samples an uninterrupted loader sees.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "tests", "distributed", "checkpoint"))

from launch import launch  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan_adapter import STATE_KEY, SteadyTitanDataLoader  # noqa: E402

from steadytrain.monitor.ledger import read_ledger  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "titan_worker.py")

pytestmark = pytest.mark.dist


def _build(data: str, **cfg: object) -> SteadyTitanDataLoader:
    return SteadyTitanDataLoader.Config(dataset_path=data, **cfg).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=32, local_batch_size=2
    )


def test_adapter_is_a_torchtitan_dataloader_and_round_trips(dataset: str) -> None:
    dl = _build(dataset)
    try:
        assert isinstance(dl, BaseDataLoader) and isinstance(dl, Stateful)
        it = iter(dl)
        for _ in range(3):
            next(it)
        sd = dl.state_dict()
        assert list(sd) == [STATE_KEY] and isinstance(sd[STATE_KEY], str)  # DCP: one bytes item
        want = [next(it) for _ in range(3)]
        fresh = _build(dataset)
        fresh.load_state_dict(sd)
        fresh.load_state_dict({})  # torchtitan: a checkpoint without a loader state loads
        got = [b for b, _ in zip(fresh, range(3), strict=False)]
        for (wi, wl), (gi, gl) in zip(want, got, strict=True):
            assert wi["input"].equal(gi["input"]) and wl.equal(gl)
        fresh.close()
    finally:
        dl.close()


def test_adapter_names_the_missing_dataset() -> None:
    with pytest.raises(ValueError, match="dataset_path is empty"):
        SteadyTitanDataLoader.Config().build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=32, local_batch_size=2
        )


@pytest.mark.timeout(240)
def test_checkpoint_manager_save_on_2_resume_on_2_and_1(dataset: str, tmp_path) -> None:
    folder, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref")
    launch(WORKER, ["save", dataset, folder, ref], world=2)
    saved = [json.load(open(f"{ref}-rank{r}.json")) for r in range(2)]
    for world in (2, 1):
        out = str(tmp_path / f"load{world}")
        launch(WORKER, ["load", dataset, folder, out], world=world)
        got = [json.load(open(f"{out}-rank{r}.json")) for r in range(world)]
        for step in ("4", "5"):
            # rank r of W reads the r-th contiguous slice of each global batch
            assert sum((g[step] for g in got), []) == saved[0][step] + saved[1][step], step
        # steadytrain.Run beside torchtitan's checkpoints (titan_run): the ledger opens the
        # attempt at the step torchtitan restored and closes it cleanly after steps 4 and 5
        recs = read_ledger(f"{out}-run/ledger.jsonl")
        starts = [r for r in recs if r["type"] == "job_start"]
        assert [(s["restored_step"], s["world_size"]) for s in starts] == [(3, world)]
        assert [r["step"] for r in recs if r["type"] == "step"] == [4, 5]
        assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
