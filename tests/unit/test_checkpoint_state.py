"""RNG capture/restore, staging buffer reuse, the CLI listing and the `auto` interval."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.staging import Stager
from steadytrain.checkpoint.state import derive_seed, rng_state, set_rng_state
from steadytrain.cli import main as cli_main


def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw()
    saved = json.loads(json.dumps(rng_state()))  # what lands in state-rankNNNNN.json
    expected = _draw()
    _draw()
    set_rng_state(saved)
    assert _draw() == expected


def test_derived_seeds_are_deterministic_and_distinct_per_rank():
    seeds = [derive_seed(100, r) for r in range(64)]
    assert len(set(seeds)) == 64 and seeds == [derive_seed(100, r) for r in range(64)]
    assert derive_seed(100, 3) != derive_seed(101, 3)


def test_stager_reuses_buffers_and_snapshots():
    model = nn.Linear(32, 16)
    stager = Stager()
    first = stager.stage({"m": model.state_dict(), "n": 3})
    ptr = first["m"]["weight"].data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(first["m"]["weight"], model.weight), "must be a copy, not a view"
    second = stager.stage({"m": model.state_dict(), "n": 3})
    assert second["m"]["weight"].data_ptr() == ptr, "the buffer is reused across saves"
    assert torch.equal(second["m"]["weight"], model.weight) and second["n"] == 3
    assert stager.bytes_staged == (32 * 16 + 16) * 4


def test_bfloat16_and_noncontiguous_tensors_stage(tmp_path):
    t = torch.randn(8, 6).to(torch.bfloat16).t()
    out = Stager().stage({"t": t})
    assert torch.equal(out["t"], t)


def test_cli_lists_committed_and_partial_newest_first(tmp_path, capsys):
    ckpt = Checkpointer(str(tmp_path), every_steps=1, async_mode="sync")
    for s in (1, 2):
        ckpt.maybe_save(s, {"model": nn.Linear(4, 4)})
    (tmp_path / "step-00000003").mkdir()
    shard = next((tmp_path / "step-00000001").glob("__0_*"))
    shard.write_bytes(shard.read_bytes()[:-1])
    # A committed checkpoint that does not verify: listed in full, then exit 2 (issue 25).
    assert cli_main(["checkpoints", str(tmp_path), "--json"]) == 2
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["state"], r["verifies"]) for r in rows] == [
        (3, "partial", False),
        (2, "committed", True),
        (1, "committed", False),
    ]
    assert "truncated" in rows[2]["error"] and rows[1]["size_bytes"] > 0
    assert cli_main(["checkpoints", str(tmp_path)]) == 2
    text = capsys.readouterr().out
    assert "step-00000002" in text and "partial" in text
    assert cli_main(["checkpoints", str(tmp_path / "nope")]) == 2


def test_auto_interval_uses_the_planner(tmp_path):
    try:
        from steadytrain.planning import optimal_interval_s
    except ImportError:
        pytest.skip("steadytrain.planning.optimal_interval_s is not in the tree yet (issue 8)")
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path), interval="auto", mtbf_s=3600.0, async_mode="sync", on_event=events.append
    )
    assert ckpt.interval_s() is None
    ckpt.maybe_save(1, {"model": nn.Linear(4, 4)})  # the first save measures the cost
    assert [e["step"] for e in events] == [1]
    want = optimal_interval_s(
        events[0]["block_s"], 3600.0, restart_s=0.0, durable_s=events[0]["durable_s"]
    )
    assert ckpt.interval_s() == pytest.approx(want)
    ckpt.maybe_save(2, {"model": nn.Linear(4, 4)})
    assert len(events) == 1 or want <= 0, "not due again before the planner's interval"


def test_real_token_loader_resumes_exactly_through_a_checkpoint(tmp_path):
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.loader import TokenLoader

    w = DatasetWriter(str(tmp_path / "ds"), vocab_size=256, eos_id=0, tokenizer={"kind": "bytes"})
    rng = np.random.default_rng(0)
    for _ in range(64):
        w.add_document(rng.integers(1, 256, size=int(rng.integers(20, 80)), dtype=np.int64))
    w.close()
    ds = TokenDataset.open(str(tmp_path / "ds"))

    def make() -> TokenLoader:
        return TokenLoader(ds, seq_len=16, global_batch=4, micro_batch=2, seed=3)

    loader = make()
    it = iter(loader)
    for _ in range(3):
        next(it)
    ckpt = Checkpointer(str(tmp_path / "ck"), async_mode="thread")
    ckpt.save(3, {"model": nn.Linear(2, 2), "loader": loader})
    ckpt.close()
    expected = next(it)["sample_ids"]
    fresh = make()
    assert (
        Checkpointer(str(tmp_path / "ck")).restore_latest(
            {"model": nn.Linear(2, 2), "loader": fresh}
        )
        == 3
    )
    assert torch.equal(next(iter(fresh))["sample_ids"], expected)
