"""``steadytrain.exact_ddp`` in one process (a gloo group of one: DDP buckets, hooks and
rebuilds all the same): the layout it emulates before DDP's rebuild is the one DDP then
builds, a wrong one is said, and what it cannot handle is left working. The bits at 3 ranks:
tests/distributed/test_ddp_exact.py."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import steadytrain.ddp as exact
from steadytrain import exact_ddp
from steadytrain.train.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=257, seq_len=16, n_layer=4, n_head=2, n_embd=128)


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(ddp: DDP, steps: int = 3) -> None:
    for s in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.manual_seed(s))
        with ddp.no_sync():  # gradient accumulation: the ready order of the last one counts
            ddp(x, x)[1].backward()
        ddp(x, x)[1].backward()


def rebuilt(ddp: DDP) -> list[list[int]]:
    text = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[int(i) for i in b.split()] for b in text.split(",")]


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def test_the_emulated_layout_is_the_one_ddp_rebuilds(group) -> None:
    ddp = exact_ddp(DDP(GPT(CFG), bucket_cap_mb=1))
    with no_warnings():
        train(ddp)
    keeper = ddp._comm_hooks[0][1]
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    emulated = [[index[id(p)] for p in bucket] for bucket in keeper.emulated]
    assert len(emulated) > 1 and emulated == rebuilt(ddp)
    assert keeper.checked and keeper.handles == []  # the timing hooks are gone


def test_a_layout_unlike_ddps_rebuild_is_warned(group, monkeypatch) -> None:
    real = exact._assign
    monkeypatch.setattr(exact, "_assign", lambda p, o, lim: real(p, o[::-1], lim))
    ddp = exact_ddp(DDP(GPT(CFG), bucket_cap_mb=1))
    with pytest.warns(RuntimeWarning, match="rebuilt its gradient buckets unlike"):
        train(ddp)


def test_a_layout_it_cannot_work_out_is_warned_and_training_goes_on(group, monkeypatch) -> None:
    def fail(*_a: object) -> None:
        raise RuntimeError("no bucket assignment here")

    monkeypatch.setattr(exact, "_assign", fail)
    model = GPT(CFG)
    ref = GPT(CFG)
    ddp = exact_ddp(DDP(model, bucket_cap_mb=1))
    with pytest.warns(RuntimeWarning, match="could not be worked out .no bucket assignment"):
        train(ddp, steps=1)
    plain = DDP(ref, bucket_cap_mb=1)
    train(plain, steps=1)  # one rank: the all-reduce is the identity, the gradients equal
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_what_it_leaves_alone(group) -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        exact_ddp(GPT(CFG))
    unused = exact_ddp(DDP(GPT(CFG), find_unused_parameters=True))  # never rebuilds
    assert unused._comm_hooks == []
    hooked = DDP(GPT(CFG))
    mine = (None, lambda state, bucket: None)
    hooked.register_comm_hook(*mine)
    with pytest.warns(RuntimeWarning, match="already has a communication hook"):
        exact_ddp(hooked)
    assert hooked._comm_hooks == [(mine[1], None)]
    twice = exact_ddp(exact_ddp(DDP(GPT(CFG))))
    assert len(twice._comm_hooks) == 1
