"""Every shuffle mode (and a blend) passes the resume contract."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from steadytrain.data.read.loader import TokenLoader

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
