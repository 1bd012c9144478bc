"""The loader's faces: DataLoader / StatefulDataLoader over ``as_dataset()`` (the same stream,
exact resume through torchdata's state), the labels conventions, and ``device=``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from steadytrain.data.read.loader import LoaderConfig, TokenLoader
from steadytrain.errors import ConfigError
from steadytrain.settings import InvalidSetting

pytestmark = pytest.mark.timeout(120)

SEQ = 16
KEYS = ("input_ids", "labels", "sample_ids")


def make(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=3)
    args.update(kw)
    return TokenLoader(ds, **args)


def take(it, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def same_stream(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for k in KEYS:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_yields_exactly_the_loader_stream(ds_a, workers):
    with make(ds_a) as ref:
        expected = take(ref, 30)  # past an epoch (20 micro-batches)
    with make(ds_a, num_workers=workers) as ld:
        dl = DataLoader(ld.as_dataset(), batch_size=None, num_workers=0)
        got = take(iter(dl), 30)
    same_stream(got, expected)


def test_stateful_dataloader_resumes_exactly(ds_a):
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    with make(ds_a) as ref:
        expected = take(ref, 27)
    k = 11  # mid-step (micro_per_step = 4)
    with make(ds_a) as ld:
        dl = sdl_mod.StatefulDataLoader(ld.as_dataset(), batch_size=None, num_workers=0)
        it = iter(dl)
        head = take(it, k)
        state = json.loads(json.dumps(dl.state_dict()))  # it goes through a JSON checkpoint
        take(it, 5)  # the interrupted run goes on a little before it dies
    same_stream(head, expected[:k])
    with make(ds_a) as fresh:  # a new process: a fresh loader and DataLoader
        dl2 = sdl_mod.StatefulDataLoader(fresh.as_dataset(), batch_size=None, num_workers=0)
        dl2.load_state_dict(state)
        tail = take(iter(dl2), len(expected) - k)
        assert fresh.step == len(expected) // fresh.micro_per_step
        # Resumed from the loader's own state, in O(1): torchdata did not fast-forward by
        # reading (and dropping) the first k micro-batches again.
        assert fresh.metrics()["micro_batches_total"] == len(expected) - k
    same_stream(tail, expected[k:])


@pytest.mark.parametrize("ahead", [1, 3])
def test_consumed_state_is_as_of_the_last_batch_trained_not_fetched(ds_a, ahead):
    """A trainer that fetches ``ahead`` micro-batches before training one (Lightning: 1)
    reports each trained one with ``consumed()``; a resume from ``consumed_state_dict()``
    starts at the first fetched-but-untrained micro-batch, where ``state_dict()`` (the
    position after the last one fetched) would skip ``ahead`` of them."""
    with make(ds_a) as ref:
        expected = take(ref, 24)
    k = 8  # trained on 8 micro-batches: a step boundary (micro_per_step = 4)
    with make(ds_a) as ld:
        face = ld.as_dataset()
        assert ld.as_dataset() is face  # one per loader: the trainer's and the callback's
        it = iter(DataLoader(face, batch_size=None, num_workers=0))
        fetched = take(it, ahead)
        assert face.consumed_state_dict() == make(ds_a).state_dict()  # nothing trained yet
        for _ in range(k):
            fetched.append(next(it))  # fetch one ahead, then train the oldest
            assert face.consumed()
        state = json.loads(json.dumps(face.consumed_state_dict()))
        assert state["step"] == 2 and state["micro_in_step"] == 0, state
        assert face.state_dict()["step"] * 4 + face.state_dict()["micro_in_step"] == k + ahead
    same_stream(fetched, expected[: k + ahead])
    with make(ds_a) as fresh:
        again = fresh.as_dataset()
        again.load_state_dict(state)
        tail = take(iter(DataLoader(again, batch_size=None, num_workers=0)), 24 - k)
    same_stream(tail, expected[k:])
    assert not make(ds_a).as_dataset().consumed()  # nothing handed out: nothing to release


def test_dataloader_workers_are_refused(ds_a):
    # Each DataLoader worker would replay the whole stream: duplicated samples.
    with make(ds_a) as ld:
        dl = DataLoader(ld.as_dataset(), batch_size=None, num_workers=1)
        with pytest.raises(ConfigError, match="num_workers=0"):
            next(iter(dl))


def test_labels_conventions_on_the_same_data(ds_a):
    with make(ds_a, labels="next") as nxt, make(ds_a, labels="same") as same:
        for _ in range(20):
            a, b = next(nxt), next(same)
            assert torch.equal(a["input_ids"], b["input_ids"])
            assert torch.equal(a["sample_ids"], b["sample_ids"])
            assert torch.equal(b["labels"], b["input_ids"])  # HF models shift inside
            assert torch.equal(a["labels"][:, :-1], a["input_ids"][:, 1:])  # shifted by one
            assert not torch.equal(a["labels"], a["input_ids"])
            b["labels"][:, 0] = -100  # a trainer masking labels in place keeps its inputs
            assert torch.equal(b["input_ids"], a["input_ids"])


def test_labels_default_is_same_and_workers_agree(ds_a):
    # The default fits Hugging Face causal-LM models; worker processes build labels apart.
    assert LoaderConfig(seq_len=SEQ, global_batch=8, micro_batch=2).labels == "same"
    for labels in ("same", "next"):
        with make(ds_a, labels=labels) as t, make(ds_a, labels=labels, num_workers=2) as w:
            same_stream(take(t, 8), take(w, 8))
    with make(ds_a, num_workers=2) as w:
        b = next(w)
        assert torch.equal(b["labels"], b["input_ids"])


def test_bad_labels_names_the_key_and_the_choices(ds_a):
    with pytest.raises(InvalidSetting, match=r"labels = 'shifted'.*\"same\".*\"next\""):
        make(ds_a, labels="shifted")


def test_micro_per_step_is_the_accumulation_count(ds_a):
    with make(ds_a, global_batch=8, micro_batch=2, world_size=2) as ld:
        assert ld.micro_per_step == 2  # 8 samples / 2 ranks / 2 per micro-batch
        take(ld, ld.micro_per_step)
        assert ld.step == 1


def test_device_moves_batches(ds_a):
    with make(ds_a, device="meta") as ld:  # any device other than the CPU the maps live on
        b = next(ld)
        assert all(v.device.type == "meta" for v in b.values())
    with make(ds_a, device="cpu") as ld, make(ds_a) as ref:
        np.testing.assert_array_equal(next(ld)["input_ids"].numpy(), next(ref)["input_ids"])


@pytest.mark.parametrize("labels", ["same", "next"])
def test_windows_are_the_loaders_samples(ds_a, labels):
    """``TokenWindows``: item i is the loader's sample i, in the loader's labels convention
    (a trainer with its own sampler, HF ``Trainer``, batches and shards them)."""
    from steadytrain import TokenWindows

    windows = TokenWindows(ds_a, SEQ, labels=labels)
    assert len(windows) == 40
    with make(ds_a, labels=labels) as ld:
        for batch in take(ld, 20):  # an epoch: every sample once
            for row, i in enumerate(batch["sample_ids"].tolist()):
                item = windows[i]
                assert torch.equal(item["input_ids"], batch["input_ids"][row])
                assert torch.equal(item["labels"], batch["labels"][row])
    with pytest.raises(IndexError, match="outside this dataset's 40 samples"):
        windows[40]
