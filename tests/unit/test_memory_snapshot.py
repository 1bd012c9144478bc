"""The memory tier's file format, store and budget, in one process (no gloo).

Round trips are bit-exact with exact types (optimizer state dicts key parameters by int and
hold tuples); a truncated, corrupted or foreign file is a ``CheckpointError`` naming it;
retention keeps at most two generations; a budget too small is refused once, with the bytes
and the fix, and training and durable checkpoints go on.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.checkpoint.memory import snapshot as snap
from steadytrain.checkpoint.memory.config import MemoryConfig
from steadytrain.checkpoint.memory.peers import pair
from steadytrain.checkpoint.memory.plan import choose
from steadytrain.checkpoint.memory.store import Store, need_by_node
from steadytrain.errors import CheckpointError, ConfigError


def same(a, b) -> bool:
    """Equal values of exactly the same types (nan equals nan; tensors bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):  # an OrderedDict comes back a dict
        return list(a) == list(b) and all(
            type(k) is type(j) and same(a[k], b[j]) for k, j in zip(a, b, strict=True)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        raw_a = a.contiguous().reshape(-1).view(torch.uint8)
        raw_b = b.contiguous().reshape(-1).view(torch.uint8)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_a, raw_b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def roundtrip(tree, meta=None):
    image = snap.build(meta or {"job": "j", "step": 3}, tree)
    header, back = snap.parse(image.copy(), "test image")
    return header, back


def trained_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 5)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def test_optimizer_state_dict_round_trips_bit_exact_with_int_keys_and_tuples():
    model, optim = trained_state()
    tree = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),  # state keyed by int, betas a tuple, step a tensor
        "extra": {
            "bf16": torch.randn(3, 2).to(torch.bfloat16),
            "i64": torch.arange(-5, 5),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
            "strided": torch.arange(12.0).reshape(3, 4).t(),
            "u8": torch.tensor([0, 255], dtype=torch.uint8),
        },
        "odd": {"__tuple__": 1, "plain": [None, True, -0.0, float("inf"), float("nan")]},
        "keys": {1: "int", (2, "b"): "tuple", None: 0, 2.5: "float", False: "bool"},
    }
    header, back = roundtrip(tree)
    assert same(back, tree)
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)
    assert list(back["optim"]["state"]) == [0, 1, 2, 3]
    assert header["payload_nbytes"] % snap.ALIGN == 0
    assert all(t["offset"] % snap.ALIGN == 0 for t in header["tensors"])
    # and loading it into fresh objects gives the same optimizer state
    model2, optim2 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)), None
    model2.load_state_dict(back["model"])
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    optim2.load_state_dict(back["optim"])
    assert same(optim2.state_dict()["state"], optim.state_dict()["state"])


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["__tensor__", "__tuple__", "__dict__"]),
    st.builds(
        lambda n, d: torch.arange(n, dtype=torch.float64).to(d) * 1.37,
        st.integers(0, 9),
        st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8]),
    ),
)
keys = st.one_of(
    st.text(max_size=10), st.integers(-3, 1000), st.sampled_from(["__tuple__", "__dict__"])
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_state_tree_round_trips_with_exact_types(tree):
    _, back = roundtrip({"t": tree})
    assert same(back, {"t": tree})


def test_refuses_what_it_cannot_store_without_pickle():
    with pytest.raises(CheckpointError, match=r"state <state>\.x is a set"):
        snap.build({}, {"x": {1, 2}})
    q = torch.quantize_per_tensor(torch.randn(4), 0.05, 3, torch.qint8)
    with pytest.raises(CheckpointError, match=r"state <state>\.q is a quantized tensor"):
        snap.build({}, {"q": q})


@pytest.fixture
def snapshot_file(tmp_path):
    model, optim = trained_state()
    path = str(tmp_path / "rank00000" / "step-000000003.snap")
    os.makedirs(os.path.dirname(path))
    snap.write_file(path, snap.build({"job": "j", "step": 3}, {"m": model.state_dict()}))
    return path


def _load(path):
    return snap.parse(snap.read_file(path), path)


def test_truncated_file_is_refused_naming_it(snapshot_file):
    size = os.path.getsize(snapshot_file)
    for keep in (size - 1, size - 200, 30, 5, 0):
        os.truncate(snapshot_file, keep)
        with pytest.raises(CheckpointError, match=f"{snapshot_file}.*(torn|short|truncated)"):
            _load(snapshot_file)


@pytest.mark.parametrize("where", ["magic", "header", "payload", "tail"])
def test_flipped_byte_is_refused_naming_it(snapshot_file, where):
    data = bytearray(open(snapshot_file, "rb").read())
    at = {"magic": 3, "header": 40, "payload": len(data) - 100, "tail": len(data) - 1}[where]
    data[at] ^= 0x01
    open(snapshot_file, "wb").write(bytes(data))
    why = {"magic": "bad magic", "header": "header", "payload": "payload checksum"}
    with pytest.raises(CheckpointError, match=f"{snapshot_file}: .*{why.get(where, 'checksum')}"):
        _load(snapshot_file)


def test_wrong_magic_and_foreign_file(tmp_path):
    path = str(tmp_path / "step-000000001.snap")
    open(path, "wb").write(b"PK\x03\x04 this is a zip file, not a snapshot" * 10)
    with pytest.raises(CheckpointError, match=f"{path}: not a steadytrain memory snapshot"):
        _load(path)
    with pytest.raises(CheckpointError, match="not a steadytrain memory snapshot"):
        snap.read_header(path)


def test_header_alone_is_verified(snapshot_file):
    assert snap.read_header(snapshot_file)["step"] == 3


def test_retention_keeps_at_most_two_generations(tmp_path):
    store = Store(str(tmp_path), "job-key")
    image = snap.build({"job": "j"}, {"x": torch.ones(10)})
    store.prepare()
    os.mkdir(store.owner_dir(0), 0o700)
    for step in range(1, 8):
        open(store.path(0, step) + ".tmp-999", "wb").close()  # a writer that died
        store.write(0, step, image)
        names = sorted(os.listdir(store.owner_dir(0)))
        assert len(names) <= 2, names
        assert not any(".tmp" in n for n in names), names
    assert store.steps(0) == [6, 7]
    store.drop_after(6)
    assert store.steps(0) == [6]


def _reserved_copy(store: Store, owner: int, step: int, value: float) -> str:
    """A copy written the way the tier writes: reserve, fill through the mapping, publish."""
    plan = snap.layout({"job": "j", "step": step}, {"x": torch.full((1000,), value)})
    tmp, image = store.reserve(owner, plan.total)
    snap.fill(plan, image)
    store.publish(tmp, owner, step)
    return tmp


def test_reserve_recycles_the_oldest_file_and_keeps_the_newest(tmp_path):
    store = Store(str(tmp_path), "k")
    _reserved_copy(store, 0, 1, 1.0)
    _reserved_copy(store, 0, 2, 2.0)
    oldest, newest = os.stat(store.path(0, 1)).st_ino, os.stat(store.path(0, 2)).st_ino
    open(os.path.join(store.owner_dir(0), "step-000000002.snap.tmp-999"), "wb").close()
    plan = snap.layout({"job": "j", "step": 3}, {"x": torch.full((1000,), 3.0)})
    tmp, image = store.reserve(0, plan.total)
    # the oldest generation's file (its pages) became the next one's; the newest is intact
    assert os.stat(tmp).st_ino == oldest and os.path.getsize(tmp) == plan.total
    assert sorted(os.listdir(store.owner_dir(0))) == [os.path.basename(tmp), "step-000000002.snap"]
    assert os.stat(store.path(0, 2)).st_ino == newest
    _, tree = snap.parse(snap.map_file(store.path(0, 2)), "step 2")
    assert torch.equal(tree["x"], torch.full((1000,), 2.0))
    snap.fill(plan, image)
    store.publish(tmp, 0, 3)
    assert store.steps(0) == [2, 3]
    _, tree = snap.parse(snap.map_file(store.path(0, 3)), "step 3")
    assert torch.equal(tree["x"], torch.full((1000,), 3.0))


def test_a_mapped_copy_is_never_written_through(tmp_path):
    store = Store(str(tmp_path), "k")
    _reserved_copy(store, 0, 1, 1.0)
    before = open(store.path(0, 1), "rb").read()
    image = snap.map_file(store.path(0, 1))
    image[:] = 0  # a restore's buffer: copy-on-write
    assert open(store.path(0, 1), "rb").read() == before


def test_a_copy_mapped_for_sending_is_read_only_and_sends_without_a_warning(tmp_path):
    import warnings

    from steadytrain.checkpoint.memory.peers import _readable

    store = Store(str(tmp_path), "k")
    _reserved_copy(store, 0, 1, 1.0)
    before = open(store.path(0, 1), "rb").read()
    image = snap.map_file(store.path(0, 1), readonly=True)
    assert image.tobytes() == before
    with pytest.raises(ValueError, match="read-only"):
        image[:1] = 0  # the holder's copy cannot be written through it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would fail here
        assert _readable(image).numpy().tobytes() == before
    fresh = snap.anonymous(4096)  # a received copy's memory: writable, zeroed
    assert fresh.flags.writeable and len(fresh) == 4096 and not fresh.any()


def test_a_received_copy_keeps_the_kept_tensors_and_gives_back_the_rest():
    from steadytrain.checkpoint.memory.restored import give_back

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    size = 64 << 20
    buf = snap.anonymous(size)  # a copy received from a peer: this restore's own memory
    buf[:] = 7
    t = torch.from_numpy(buf)
    kept = [t[10_000_000:10_000_064], {"exp_avg": t[40_000_000:41_000_000]}]
    before = resident_mib()
    give_back(buf, kept)  # the modules' share, loaded into their parameters
    assert before - resident_mib() > 50  # 62 of its 64 MiB went back
    assert bool((kept[0] == 7).all()) and bool((kept[1]["exp_avg"] == 7).all())
    assert not buf[:4096].any() and not buf[-4096:].any() and not buf[20_000_000]
    plain = np.full(1 << 16, 7, np.uint8)  # not a mapping of its own: left as it is
    give_back(plain, [])
    assert bool((plain == 7).all())


def test_reserve_on_a_full_tmpfs_is_an_error_not_a_crash(tmp_path):
    from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

    try:
        with tmpfs(tmp_path / "shm", "1M") as shm:
            store = Store(shm, "k")
            _reserved_copy(store, 0, 1, 1.0)  # a small copy fits
            with pytest.raises(OSError) as err:
                store.reserve(0, 4 << 20)  # filling this mapping would be a SIGBUS
            assert "No space left" in str(err.value)
            assert sorted(os.listdir(store.owner_dir(0))) == ["step-000000001.snap"]
            _, tree = snap.parse(snap.map_file(store.path(0, 1)), "step 1")
            assert torch.equal(tree["x"], torch.full((1000,), 1.0))
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


def test_scan_passes_over_bad_and_foreign_copies(tmp_path):
    store = Store(str(tmp_path), "k")
    for owner in (0, 1):
        for step in (4, 5):
            meta = {"job": "j", "step": step, "owner": owner, "world_size": 2}
            store.write(owner, step, snap.build(meta, {"x": torch.full((3,), step)}))
    os.truncate(store.path(1, 5), 70)
    found, passed = store.scan("j", 2)
    assert sorted(found[0]) == [4, 5] and sorted(found[1]) == [4]
    assert [p["step"] for p in passed] == [5] and "torn" in passed[0]["reason"]
    found, passed = store.scan("j", 4)
    assert not found and sum("the job now has 4" in p["reason"] for p in passed) == 3


def test_plan_picks_newest_complete_step_memory_wins_a_tie():
    # held[rank][owner][step]: rank 0 and 1 on one node, 2 on another
    held = [
        {0: {5: (10, "a"), 6: (10, "b")}, 1: {5: (11, "c")}},
        {0: {5: (10, "a"), 6: (10, "b")}, 1: {5: (11, "c")}},
        {1: {5: (11, "c"), 6: (11, "d")}, 2: {5: (12, "e"), 6: (12, "f")}, 0: {6: (10, "b")}},
    ]
    step, sources = choose(held, 3, durable_step=0)
    assert step == 6 and sources == {0: (0, 10), 1: (2, 11), 2: (2, 12)}
    assert choose(held, 3, durable_step=6)[0] == 6  # a tie: memory
    assert choose(held, 3, durable_step=7) is None  # durable is newer
    assert choose(held, 4, durable_step=0) is None  # rank 3 has nothing


def test_pairing_sends_to_the_next_node():
    p = pair(["n1", "n1", "n2", "n2", "n3", "n3"])
    assert p.peer_of == [2, 3, 4, 5, 0, 1]
    assert p.holds_for(0) == [4]
    assert pair(["x", "x"]).peer_of == [None, None]  # one node: no peer
    assert pair(["a", "b", "b"]).peer_of == [1, 0, 0]  # uneven: node b keeps a's copy
    assert need_by_node(["a", "b", "b"], [10, 20, 30], [1, 0, 0]) == {"a": 120, "b": 120}


def _job(tmp_path, **memory):
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    events: list[dict] = []
    cfg = CheckpointerConfig(
        every_steps=2,
        async_mode="sync",
        job_id="unit",
        memory=MemoryConfig(dir=str(tmp_path / "mem"), **memory),
    )
    ckpt = Checkpointer(str(tmp_path / "ckpt"), config=cfg, on_event=events.append)
    return model, optim, ckpt, events


def test_budget_refusal_is_one_event_and_training_goes_on(tmp_path):
    model, optim, ckpt, events = _job(tmp_path, every_steps=1, budget_bytes=4096)
    states = {"model": model, "optim": optim}
    for step in range(1, 5):
        ckpt.maybe_save(step, states)
    ckpt.close()
    snaps = [e for e in events if e["type"] == "memory_snapshot"]
    assert len(snaps) == 1 and not snaps[0]["ok"], snaps  # refused once, then off
    error = snaps[0]["error"]
    assert "needs" in error and "budget is 4096 bytes" in error
    assert "checkpoint.memory.budget_bytes" in error and "every_steps = 0" in error
    durable = [e for e in events if e["type"] == "checkpoint"]
    assert [e["ok"] for e in durable] == [True, True]  # durable checkpoints went on


def test_one_process_restores_from_memory_bit_exact(tmp_path):
    model, optim, ckpt, events = _job(tmp_path, every_steps=1)
    states = {"model": model, "optim": optim}
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.add_(step)
        model(torch.ones(2, 64)).sum().backward()
        optim.step()
        ckpt.maybe_save(step, states, tokens_seen=step * 7)
    ckpt.wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = optim.state_dict()
    rng = torch.get_rng_state()
    torch.rand(3)  # move the RNG on: the restore must put it back
    # a crash: no close; a new process restores
    model2, optim2, ckpt2, events2 = _job(tmp_path, every_steps=1)
    step = ckpt2.restore_latest({"model": model2, "optim": optim2})
    assert step == 3 and ckpt2.tokens_seen == 21
    restore = [e for e in events2 if e["type"] == "restore"][0]
    assert restore["tier"] == "local-memory" and restore["bytes_local"] > 0
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    assert same(optim2.state_dict()["state"], want_optim["state"])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(e["ok"] for e in events if e["type"] == "memory_snapshot")
    ckpt2.close()  # memory (step 3) is newer than any durable save of this process: kept
    assert os.listdir(tmp_path / "mem")


def test_clean_close_removes_the_memory_directory(tmp_path):
    model, optim, ckpt, events = _job(tmp_path, every_steps=1)
    for step in (1, 2):
        ckpt.maybe_save(step, {"model": model, "optim": optim})
    ckpt.close()  # the durable save of step 2 holds everything
    assert os.listdir(tmp_path / "mem") == []


def test_close_releases_the_staging_buffers_at_once(tmp_path):
    """The tier's staging buffers (1x the state per rank) are not resident after close(),
    without waiting for a garbage collection: the snapshot encoder's recursive closure held
    the last generation's tensors in a reference cycle (issue 40, item 8)."""
    import gc
    import weakref

    model, optim, ckpt, _ = _job(tmp_path, every_steps=1)
    gc.disable()  # as between two automatic collections, which may be far apart
    try:
        for step in (1, 2, 3):
            ckpt.maybe_save(step, {"model": model, "optim": optim})
        ckpt.wait()
        staged = [weakref.ref(b) for b in ckpt.memory.stager._buffers.values()]
        assert len(staged) >= 3  # weight, bias, momentum
        ckpt.close()
        assert [r() is None for r in staged] == [True] * len(staged)
    finally:
        gc.enable()


def test_config_checks_and_tables():
    with pytest.raises(ConfigError, match="every_steps = -1"):
        MemoryConfig(every_steps=-1)
    with pytest.raises(ConfigError, match="memory.budget_bytes"):
        CheckpointerConfig(memory={"budget_bytes": -5})
    cfg = CheckpointerConfig(memory={"every_steps": 3})
    assert cfg.memory == MemoryConfig(every_steps=3)
    from steadytrain.train.config import apply_overrides, config_from_dict

    data = {"dataset": "d", "seq_len": 8, "global_batch": 4, "micro_batch": 1}
    raw = apply_overrides({"data": data}, ["checkpoint.memory.every_steps=1"])
    assert config_from_dict(raw).checkpoint.memory.every_steps == 1


def test_image_buffer_is_reused():
    tree = {"x": torch.ones(100)}
    first = snap.build({"step": 1}, tree)
    again = snap.build({"step": 2}, tree, out=first)
    assert again is first and snap.verify(again, "reused")["step"] == 2
    assert isinstance(first, np.ndarray)
