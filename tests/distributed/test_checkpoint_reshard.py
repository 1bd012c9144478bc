"""Real multi-process DDP and FSDP2 over gloo: save on 2 ranks, load on 1 and on 4.

Model, optimizer (AdamW moments and step), LR scheduler, loader state, tokens seen and per-rank
RNG must come back bit-identical; ranks beyond the saved two get the documented derived seed.
DDP saves with the ``thread`` mode, FSDP2 (DTensor shards) with the ``process`` mode.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

WORKER = os.path.join(HERE, "worker.py")
SPECS = "ddp:thread,fsdp:process"

pytestmark = pytest.mark.dist


@pytest.mark.timeout(240)
def test_save_on_2_load_on_1_and_4(tmp_path):
    ref = str(tmp_path / "ref")
    outs = launch(WORKER, ["save", SPECS, str(tmp_path), ref], world=2)
    assert all("save fsdp ok" in o for o in outs)
    for kind in ("ddp", "fsdp"):
        commit = json.loads((tmp_path / kind / "step-00000004" / "COMMIT").read_text())
        assert commit["world"]["world_size"] == 2
        ranks = {f["rank"] for f in commit["files"]}
        assert ranks == {0, 1}, "every rank must write its own shard"
        assert sum(commit["world"]["bytes_per_rank"]) == commit["total_bytes"]
    for world in (1, 4):
        outs = launch(WORKER, ["load", SPECS, str(tmp_path), ref], world=world)
        assert sum("load fsdp ok" in o for o in outs) == world
