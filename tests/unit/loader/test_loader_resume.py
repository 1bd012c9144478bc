"""Every shuffle mode (and a blend) passes the resume contract; a resume with another global
batch continues at the saved sample position."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from steadytrain.data.read.loader import TokenLoader
from steadytrain.errors import LoaderStateError

_spec = importlib.util.spec_from_file_location(
    "resume_contract", os.path.join(os.path.dirname(__file__), "resume_contract.py")
)
resume_contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resume_contract)

SEQ, G = 16, 8


def read_step(loader: TokenLoader) -> dict[str, np.ndarray]:
    batches = [next(loader) for _ in range(loader.micro_per_step)]
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in batches[0]}


def maker(datasets, **kw):
    def make(world_size: int, rank: int, num_workers: int) -> TokenLoader:
        micro = 2 if G // world_size >= 2 else 1
        return TokenLoader(
            datasets,
            SEQ,
            G,
            micro,
            rank=rank,
            world_size=world_size,
            seed=7,
            num_workers=num_workers,
            **kw,
        )

    return make


# ds_a has 40 samples: 5 steps of 8 per epoch. k=0 start, 2 mid-epoch, 5 epoch boundary,
# 7 mid second epoch; the run crosses into the third epoch.
CASES = {
    "global": dict(shuffle="global"),
    "block": dict(shuffle="block", shuffle_settings={"block_size": 3, "window_blocks": 2}),
    "sequential": dict(shuffle="sequential"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(CASES))
def test_resume_contract_single_dataset(ds_a, mode):
    make = maker(ds_a, **CASES[mode])
    resume_contract.check_resume_contract(
        make, read_step, total_steps=12, ks=[0, 2, 5, 7], worker_ks=[5]
    )


@pytest.mark.timeout(120)
def test_resume_contract_blend(ds_a, ds_b):
    # ds_b (24 samples at 1/4 of positions) ends its first epoch inside step 12; ds_a
    # (40 samples at 3/4) inside step 6.
    make = maker([ds_a, ds_b], weights=[3, 1], return_position_ids=True, return_doc_ids=True)
    resume_contract.check_resume_contract(
        make, read_step, total_steps=14, ks=[0, 3, 6, 12], worker_ks=[6]
    )


# -- a changed global batch on resume (the stream is positional) ------------------------


def _stream(datasets, steps: int, **kw) -> dict[str, np.ndarray]:
    """The uninterrupted stream at G=8 on one rank, rows in position order."""
    with TokenLoader(datasets, SEQ, G, 2, seed=7, **kw) as ld:
        parts = [read_step(ld) for _ in range(steps)]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("sample_ids", "input_ids")}


def _saved_at(datasets, step: int, global_batch: int = G, **kw) -> dict:
    with TokenLoader(datasets, SEQ, global_batch, 2, seed=7, **kw) as ld:
        for _ in range(step):
            read_step(ld)
        return json.loads(json.dumps(ld.state_dict()))


BATCH_CASES = {
    "global": ("a", CASES["global"]),
    "block": ("a", CASES["block"]),
    "blend": ("ab", dict(weights=[3, 1])),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_resume_with_another_global_batch_continues_at_the_saved_sample(ds_a, ds_b, case):
    """Saved at step 3 with G=8 (24 samples read), resumed with G=16 on 1, 2 and 4 ranks
    (and worker processes): the steps after it are the next 16-sample slices of the very same
    stream, and the change is reported for the ledger."""
    which, kw = BATCH_CASES[case]
    datasets = [ds_a, ds_b] if which == "ab" else ds_a
    ref = _stream(datasets, 3 + 3 * 2 + 2, **kw)  # positions 0 .. 88: crosses epochs
    state = _saved_at(datasets, 3, **kw)
    assert state["version"] == 2 and state["position"] == 24
    for world, workers in ((1, 0), (2, 0), (4, 0), (1, 2)):
        ranks = [
            TokenLoader(
                datasets, SEQ, 16, 2, rank=r, world_size=world, seed=7, num_workers=workers, **kw
            )
            for r in range(world)
        ]
        try:
            for ld in ranks:
                ld.load_state_dict(state)
                assert ld.step == 3 and ld.position == 24
                assert ld.resume_changes == [
                    {"key": "global_batch", "old": 8, "new": 16, "step": 3, "position": 24}
                ]
            for i in range(3):
                parts = [read_step(ld) for ld in ranks]
                lo, hi = 24 + 16 * i, 24 + 16 * (i + 1)
                for key in ("sample_ids", "input_ids"):
                    got = np.concatenate([p[key] for p in parts])
                    assert np.array_equal(got, ref[key][lo:hi]), (
                        f"{key} of step {4 + i} on world_size={world}, workers={workers}"
                    )
            assert ranks[0].step == 6 and ranks[0].position == 72
            later = ranks[0].state_dict()
        finally:
            for ld in ranks:
                ld.close()
    # ... and back to G=8 from that state: the stream goes on at sample 72.
    assert later["position"] == 72 and later["global_batch"] == 16
    with TokenLoader(datasets, SEQ, G, 2, seed=7, **kw) as ld:
        ld.load_state_dict(later)
        assert ld.resume_changes[0]["old"] == 16 and ld.resume_changes[0]["new"] == 8
        got = read_step(ld)
        assert np.array_equal(got["sample_ids"], ref["sample_ids"][72:80])


def test_look_ahead_after_a_batch_change_follows_the_new_steps(ds_a):
    """The cache prefetcher's (step, shard) schedule uses the resumed steps' positions."""
    state = _saved_at(ds_a, 3, shuffle="sequential")
    with TokenLoader(ds_a, SEQ, 16, 2, seed=7, shuffle="sequential") as ld:
        ld.load_state_dict(state)
        for lo, hi, kw in ((0, 16, {}), (8, 16, {"ranks": [1], "world_size": 2})):
            first: dict[int, int] = {}
            for step in range(3, 8):
                start = 24 + 16 * (step - 3)  # step 3 starts at the saved sample 24
                for shard in ld.sampler.locate(np.arange(start + lo, start + hi)).shard.tolist():
                    first.setdefault(shard, step)
            want = sorted(((s, sh) for sh, s in first.items()), key=lambda t: t[0])
            assert ld.shards_for_steps(3, 8, **kw) == want, kw


def test_version_1_states_load_and_mid_step_batch_changes_are_refused(ds_a):
    v1 = _saved_at(ds_a, 3)
    v1["version"] = 1
    del v1["position"]  # version 1: position is step * global_batch
    with TokenLoader(ds_a, SEQ, 16, 2, seed=7) as ld:
        ld.load_state_dict(v1)
        assert ld.position == 24
        assert np.array_equal(read_step(ld)["sample_ids"], _stream(ds_a, 5)["sample_ids"][24:40])
    with TokenLoader(ds_a, SEQ, G, 2, seed=7) as ld:
        next(ld)  # one micro-batch into step 0
        mid = ld.state_dict()
    with (
        TokenLoader(ds_a, SEQ, 16, 2, seed=7) as ld,
        pytest.raises(
            LoaderStateError,
            match=r"saved mid-step \(micro_in_step=1\) with global_batch=8, loader has "
            r"global_batch=16",
        ),
    ):
        ld.load_state_dict(mid)
    with (
        TokenLoader(ds_a, 8, 16, 2, seed=7) as ld,
        pytest.raises(LoaderStateError, match="saved with seq_len=16, loader has seq_len=8"),
    ):
        ld.load_state_dict(_saved_at(ds_a, 3))
