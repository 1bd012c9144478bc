"""TokenLoader: batch contents, document info, metrics, state validation, read deadline."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch

from steadytrain.data.read.loader import LoaderConfig, TokenLoader
from steadytrain.errors import ConfigError, LoaderStateError, ReadDeadlineError

SEQ = 16


def loader(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=1)
    args.update(kw)
    return TokenLoader(ds, **args)


def test_batches_hold_the_samples_they_name(ds_a):
    with loader(ds_a, labels="next") as ld:
        seen = []
        for _ in range(20):  # one epoch: 5 steps of 4 micro-batches
            b = next(ld)
            assert set(b) == {"input_ids", "labels", "sample_ids"}
            assert b["input_ids"].dtype == torch.int64 and b["input_ids"].shape == (2, SEQ)
            assert b["labels"].shape == (2, SEQ) and b["sample_ids"].shape == (2,)
            for row, sid in enumerate(b["sample_ids"].tolist()):
                refs = ld.sampler.locate(np.array([0]))  # warm the lookup path
                cum = ld.sampler.cum[0]
                shard = int(np.searchsorted(cum, sid, side="right") - 1)
                off = (sid - int(cum[shard])) * SEQ
                window = np.asarray(ds_a.tokens(shard)[off : off + SEQ + 1], dtype=np.int64)
                assert np.array_equal(b["input_ids"][row].numpy(), window[:-1])
                assert np.array_equal(b["labels"][row].numpy(), window[1:])
                assert refs.shard.size == 1
            seen.extend(b["sample_ids"].tolist())
        assert sorted(seen) == list(range(40))  # every sample exactly once per epoch


def test_doc_and_position_ids_follow_document_boundaries(ds_a):
    with loader(ds_a, return_doc_ids=True, return_position_ids=True, shuffle="sequential") as ld:
        for _ in range(20):
            b = next(ld)
            for row, sid in enumerate(b["sample_ids"].tolist()):
                cum = ld.sampler.cum[0]
                shard = int(np.searchsorted(cum, sid, side="right") - 1)
                off = (sid - int(cum[shard])) * SEQ
                ends = np.asarray(ds_a.doc_ends(shard), dtype=np.int64)
                starts = np.r_[0, ends[:-1]]
                want_pos, want_doc = [], []
                for p in range(off, off + SEQ):
                    d = int(np.searchsorted(ends, p, side="right"))
                    want_pos.append(p - starts[d])
                    want_doc.append(d)
                assert b["position_ids"][row].tolist() == want_pos
                assert b["doc_ids"][row].tolist() == [d - want_doc[0] for d in want_doc]
                # A position id restarts right after each EOS in the inputs.
                inp = b["input_ids"][row].numpy()
                after_eos = np.flatnonzero(inp[:-1] == 0) + 1
                assert (b["position_ids"][row].numpy()[after_eos] == 0).all()


def test_metrics_and_wait_are_reported_per_step(ds_a):
    steps = []
    with loader(ds_a, on_step=steps.append) as ld:
        for _ in range(4):
            next(ld)
        m = ld.metrics()
        assert m["micro_batches"] == 4 and m["samples"] == 8 and m["tokens"] == 8 * SEQ
        assert m["bytes_read"] == 8 * (SEQ + 1) * 2  # uint16 windows
        assert m["read_p99_s"] >= m["read_p50_s"] > 0
        # the reads' own time this step: the sum of the 4 reads the percentiles are of
        assert m["read_p99_s"] <= m["read_s"] <= 4.2 * m["read_p99_s"]
        assert ld.last_data_wait_s >= 0 and m["data_wait_s"] >= ld.last_data_wait_s
        m = ld.metrics()
        assert m["micro_batches"] == 0 and m["read_s"] == 0  # counters restart at every call
        assert ld.step == 1 and ld.position == 8
        next(ld)
        assert steps == [0, 1]
        assert ld.metrics()["bytes_read_total"] == 5 * 2 * (SEQ + 1) * 2


def test_state_is_json_and_a_dcp_stateful(ds_a):
    from torch.distributed.checkpoint.stateful import Stateful

    with loader(ds_a) as ld:
        assert isinstance(ld, Stateful)
        for _ in range(6):
            next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
        assert sd["step"] == 1 and sd["micro_in_step"] == 2 and sd["seq_len"] == SEQ
        assert sd["fingerprint"] == ds_a.fingerprint
        rest = [next(ld)["sample_ids"].tolist() for _ in range(5)]
    with loader(ds_a) as other:
        other.load_state_dict(sd)
        assert [next(other)["sample_ids"].tolist() for _ in range(5)] == rest


def test_synchronous_mode_reads_the_same_stream(ds_a):
    with loader(ds_a, prefetch=0) as sync, loader(ds_a, prefetch=3) as threaded:
        for _ in range(10):
            a, b = next(sync), next(threaded)
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert sync._producer is None and sync.state_dict() == threaded.state_dict()


def saved(ds, **kw) -> dict:
    with loader(ds, **kw) as ld:
        for _ in range(4):
            next(ld)
        return ld.state_dict()


@pytest.mark.parametrize(
    "saved_kw, loader_kw, match",
    [
        ({"seq_len": 8}, {}, "saved with seq_len=8, loader has seq_len=16"),
        (  # 4 of 6 micro-batches: mid-step (between steps another global batch loads)
            {"global_batch": 24, "micro_batch": 4},
            {},
            r"saved mid-step \(micro_in_step=4\) with global_batch=24, loader has global_batch=8",
        ),
        ({"seed": 2}, {}, "saved with seed=2, loader has seed=1"),
        (
            {"shuffle": "sequential"},
            {},
            "saved with shuffle='sequential', loader has shuffle='global'",
        ),
        (
            {"shuffle": "block", "shuffle_settings": {"block_size": 2, "window_blocks": 2}},
            {"shuffle": "block", "shuffle_settings": {"block_size": 4, "window_blocks": 2}},
            "saved with mode_settings=.*'block_size': 2.*loader has mode_settings=.*'block_size': 4",
        ),
    ],
)
def test_load_refuses_another_order(ds_a, saved_kw, loader_kw, match):
    sd = saved(ds_a, **saved_kw)
    with loader(ds_a, **loader_kw) as ld, pytest.raises(LoaderStateError, match=match):
        ld.load_state_dict(sd)


def test_load_refuses_other_mixtures_and_changed_data(ds_a, ds_b):
    blended = saved([ds_a, ds_b], weights=[3, 1])
    with (
        loader([ds_a, ds_b], weights=[1, 1]) as ld,
        pytest.raises(
            LoaderStateError, match=r"saved with blend_period=4, loader has blend_period=2"
        ),
    ):
        ld.load_state_dict(blended)
    with (
        loader([ds_a, ds_b], weights=[1, 3]) as ld,
        pytest.raises(
            LoaderStateError, match=r"saved with mixture weights \[3, 1\], loader has \[1, 3\]"
        ),
    ):
        ld.load_state_dict(blended)
    sd = saved(ds_a)
    with (
        loader(ds_b) as ld,
        pytest.raises(
            LoaderStateError,
            match=f"saved with dataset fingerprint {ds_a.fingerprint}.*allow_dataset_change=True",
        ),
    ):
        ld.load_state_dict(sd)
    with loader(ds_b, allow_dataset_change=True) as ld:
        ld.load_state_dict(sd)
        assert ld.step == 1 and next(ld)["input_ids"].shape == (2, SEQ)


def test_load_refuses_mid_step_state_on_another_world_and_bad_input(ds_a):
    with loader(ds_a) as ld:
        next(ld)
        mid = ld.state_dict()
    with loader(ds_a, world_size=2, rank=0) as ld:
        with pytest.raises(
            LoaderStateError, match="saved mid-step .* with world_size=1, loader has world_size=2"
        ):
            ld.load_state_dict(mid)
        with pytest.raises(LoaderStateError, match="not a steadytrain loader state"):
            ld.load_state_dict({"step": 3})
        with pytest.raises(LoaderStateError, match="version 9 is not supported"):
            ld.load_state_dict({**mid, "version": 9})
        with pytest.raises(LoaderStateError, match="negative cursor"):
            ld.load_state_dict({**saved(ds_a), "step": -1})
    with loader(ds_a, micro_batch=4) as ld:  # between steps any micro-batch size loads
        ld.load_state_dict(saved(ds_a))
        assert ld.step == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_workers": -1}, "num_workers = -1 is invalid: use 0"),
        ({"prefetch": -1}, "prefetch = -1 is invalid: use 0"),
        ({"prefetch": 0, "read_timeout_s": 1.0}, "prefetch=0 reads synchronously"),
        ({"prefetch": 0, "num_workers": 2}, "prefetch=0 reads synchronously"),
        ({"read_timeout_s": 0}, "read_timeout_s = 0 is invalid: use > 0"),
        ({"world_size": 3}, "world_size=3 does not divide global_batch=8"),
        ({"micro_batch": 3}, r"global_batch = 8 is invalid: use a positive multiple of micro_b"),
        ({"seq_len": 1000}, "no shard with more than seq_len=1000"),
        ({"shuffle": "nope"}, r"shuffle = 'nope' is invalid: choose one of \['block', 'global'"),
        ({"weights": [-1]}, r"weights = \[-1\] is invalid: weight 0 is -1"),
    ],
)
def test_construction_errors_name_the_setting(ds_a, kw, match):
    with pytest.raises(ConfigError, match=match):
        loader(ds_a, **kw)


def test_config_and_keywords_are_one_loader(ds_a, ds_b):
    """``config=LoaderConfig(...)`` and the keywords build the same loader (same stream,
    same state); a keyword given with ``config=`` wins; nothing has a second default."""
    config = LoaderConfig(seq_len=SEQ, global_batch=8, micro_batch=2, weights=[2, 1], prefetch=1)
    with (
        TokenLoader([ds_a, ds_b], seed=1, config=config) as by_config,
        loader([ds_a, ds_b], weights=[2, 1], prefetch=1) as by_keywords,
    ):
        assert by_config.config == by_keywords.config == config
        for _ in range(6):
            assert torch.equal(next(by_config)["sample_ids"], next(by_keywords)["sample_ids"])
        assert by_config.state_dict() == by_keywords.state_dict()
    plain = LoaderConfig(seq_len=SEQ, global_batch=8, micro_batch=2)
    with TokenLoader(ds_a, seed=1, micro_batch=4, config=plain) as ld:
        assert ld.micro_batch == 4 and ld.config.micro_batch == 4
    with pytest.raises(ConfigError, match="seq_len, global_batch, micro_batch must be given"):
        TokenLoader(ds_a)


@pytest.mark.timeout(60)
def test_stuck_read_in_thread_becomes_deadline_error(ds_a, tmp_path):
    from steadytrain.data.read.dataset import TokenDataset

    ds = TokenDataset.open(ds_a.url)
    release = []

    def stuck_resolver(name: str, size: int, checksum: str) -> str:
        # The resolver is where the shard cache fetches a remote shard: make it hang.
        while not release:
            time.sleep(0.02)
        return ds.store.local_path(name)

    ds._resolver = stuck_resolver
    ld = loader(ds, read_timeout_s=0.3, shuffle="sequential")
    with pytest.raises(ReadDeadlineError) as err:
        next(ld)
    release.append(True)
    msg = str(err.value)
    assert "read_timeout_s=0.3" in msg and "shards/shard-00000.tokens" in msg
    assert "stuck reading" in msg and "micro-batch 0 (step 0)" in msg


@pytest.mark.timeout(60)
def test_stalled_worker_becomes_deadline_error_and_workers_are_processes(ds_a):
    ld = loader(ds_a, num_workers=2, read_timeout_s=1.0)
    next(ld)
    pids = ld._producer.pids
    assert len(pids) == 2 and os.getpid() not in pids
    for _ in range(8):  # let the pipes fill, then freeze both workers mid-stream
        next(ld)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(
            ReadDeadlineError,
            match=r"micro-batch \d+ \(step \d+\) was not read within read_timeout_s=1.0",
        ):
            for _ in range(100_000):  # drain what the pipes and the queue already hold
                next(ld)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        ld.close()
    for pid in pids:  # close() ended them
        with pytest.raises(ProcessLookupError):
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.05)
