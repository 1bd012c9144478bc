"""Fuzzers for the data wing's readers of untrusted files (issue 25): the dataset manifest,
the loader state and the cache's stamps. Mutated, truncated, type-swapped, oversized and
special-file input; each asserts that only the documented error type escapes
(``DatasetError`` for a manifest, ``LoaderStateError`` for a loader state, nothing for a
stamp) and that what is accepted is sane."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset, open_shard_cache
from steadytrain.data.read.format import read_manifest
from steadytrain.data.read.loader import TokenLoader
from steadytrain.errors import DatasetError, LoaderStateError
from steadytrain.storage.publish import canonical_digest, file_checksum
from steadytrain.storage.store import Store

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VOCAB, EOS, SEQ = 300, 299, 8

# JSON values of every type, including the awkward ones: huge and negative integers, NaN and
# infinities (Python's json reads and writes them), long strings, nested containers.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 10**18, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["uint16", "uint32", "../x", "/etc/passwd", ".", "shards", "x" * 5000])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON value (the root included)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _mutate(base: Any, path: tuple, action: str, value: Any) -> Any:
    """A deep copy of ``base`` with the value at ``path`` replaced or deleted."""
    if not path:
        return value
    out = copy.deepcopy(base)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def _deep(depth: int) -> list:
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def _write_dataset(root: str) -> str:
    rng = np.random.default_rng(0)
    with DatasetWriter(
        root, vocab_size=VOCAB, eos_id=EOS, tokenizer={"type": "test"}, shard_tokens=40
    ) as w:
        for _ in range(12):
            w.add_document(np.r_[rng.integers(1, EOS, size=9), EOS])
    return root


@pytest.fixture(scope="module")
def dataset() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="fuzz-ds-")
    yield _write_dataset(os.path.join(root, "ds"))
    shutil.rmtree(root, ignore_errors=True)


# -- the manifest ---------------------------------------------------------------------------
def _refingerprint(obj: Any) -> None:
    """Recompute the fingerprint (format.md A.4) where the mutated shape allows, so a
    mutation reaches the checks behind the fingerprint instead of stopping at it."""
    try:
        obj["fingerprint"] = canonical_digest(
            {
                "dtype": obj["dtype"],
                "eos_id": obj["eos_id"],
                "fingerprint_version": 2,
                "format": "steadytrain.tokens",
                "shards": [
                    [s["tokens"], s["docs"], s["checksum"], s["index"]["checksum"]]
                    for s in obj["shards"]
                ],
                "version": 1,
                "vocab_size": obj["vocab_size"],
            }
        )
    except (KeyError, TypeError, IndexError, ValueError):
        pass


def _open_and_read(ds: str) -> None:
    """Open as a trainer does and touch every map; accepted data must be sane."""
    try:
        m = read_manifest(Store(ds))
    except DatasetError:
        return
    assert m.num_tokens >= 0 and m.num_docs >= 0 and 0 <= m.eos_id < m.vocab_size
    for s in m.shards:
        assert s.bytes == s.tokens * m.itemsize and s.index_bytes == s.docs * 8
    try:
        data = TokenDataset.open(ds)
    except DatasetError:
        return
    for i, s in enumerate(m.shards):
        assert np.asarray(data.tokens(i)).size == s.tokens
        assert np.asarray(data.doc_ends(i)).size == s.docs


@pytest.fixture
def manifest_bytes(dataset) -> Iterator[bytes]:
    path = os.path.join(dataset, "manifest.json")
    original = open(path, "rb").read()
    yield original
    with open(path, "wb") as f:
        f.write(original)


def _put_manifest(dataset: str, data: bytes) -> None:
    path = os.path.join(dataset, "manifest.json")
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)


@FUZZ
@given(data=st.data(), action=st.sampled_from(["replace", "delete"]), refp=st.booleans())
def test_fuzz_manifest_mutated_fields(dataset, manifest_bytes, data, action, refp):
    base = json.loads(manifest_bytes)
    paths = list(_paths(base))
    path = data.draw(st.sampled_from(paths))
    if action == "delete" and not path:
        action = "replace"
    obj = _mutate(base, path, action, data.draw(VALUES))
    if refp and isinstance(obj, dict):
        _refingerprint(obj)
    _put_manifest(dataset, json.dumps(obj).encode())
    _open_and_read(dataset)


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_truncated_and_flipped_bytes(dataset, manifest_bytes, data):
    raw = bytearray(manifest_bytes)
    cut = data.draw(st.integers(0, len(raw)))
    if data.draw(st.booleans()):
        raw = raw[:cut]
    elif raw:
        i = min(cut, len(raw) - 1)
        raw[i] ^= data.draw(st.integers(1, 255))
    _put_manifest(dataset, bytes(raw))
    _open_and_read(dataset)


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 200_000 + b"]" * 200_000,  # nesting past the recursion limit
        b'{"format": "steadytrain.tokens", "version": 1, "vocab_size": ' + b"9" * 5000 + b"}",
        b'{"format": "steadytrain.tokens", "version": 1, "dtype": "uint16", "vocab_size": NaN}',
        b"\xff\xfe\x00garbage",
        b"",
    ],
)
def test_manifest_oversized_or_odd_json_is_a_dataset_error(dataset, manifest_bytes, payload):
    _put_manifest(dataset, payload)
    with pytest.raises(DatasetError, match="manifest.json"):
        read_manifest(Store(dataset))


@pytest.mark.parametrize("kind", ["fifo", "dir", "devzero", "huge"])
def test_manifest_special_files_are_refused_without_reading(dataset, manifest_bytes, kind):
    path = os.path.join(dataset, "manifest.json")
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)  # endless bytes
    else:
        with open(path, "wb") as f:
            f.truncate((1 << 30) + 1)  # sparse: costs no disk, too big to read
    try:
        with pytest.raises(DatasetError, match="manifest.json"):
            read_manifest(Store(dataset))
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


# -- the loader state -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_state(dataset) -> dict:
    with TokenLoader(
        TokenDataset.open(dataset), seq_len=SEQ, global_batch=4, micro_batch=2, num_workers=0
    ) as lo:
        for _ in range(3):
            next(lo)
        return lo.state_dict()


@pytest.fixture(scope="module")
def target(dataset) -> Iterator[TokenLoader]:
    lo = TokenLoader(
        TokenDataset.open(dataset), seq_len=SEQ, global_batch=4, micro_batch=2, num_workers=0
    )
    yield lo
    lo.close()


def _load(target: TokenLoader, state: Any) -> None:
    """Load; an accepted state must resume somewhere sane and serve a valid batch."""
    try:
        target.load_state_dict(state)
    except LoaderStateError:
        return
    sd = target.state_dict()
    assert 0 <= sd["step"] and 0 <= sd["position"] and 0 <= sd["micro_in_step"] < 2
    batch = next(target)
    assert batch["input_ids"].shape == (2, SEQ)
    assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < VOCAB
    target.close()


@FUZZ
@given(data=st.data(), action=st.sampled_from(["replace", "delete", "add"]))
def test_fuzz_loader_state_mutated_fields(saved_state, target, data, action):
    paths = list(_paths(saved_state))
    if action == "add":
        state = dict(saved_state)
        state[data.draw(st.text(max_size=10))] = data.draw(VALUES)
    else:
        path = data.draw(st.sampled_from(paths))
        if action == "delete" and not path:
            action = "replace"
        state = _mutate(saved_state, path, action, data.draw(VALUES))
    _load(target, state)


@FUZZ
@given(value=VALUES)
def test_fuzz_loader_state_of_any_json_value(target, value):
    _load(target, value)


@pytest.mark.parametrize("key", ["seq_len", "step", "fingerprint", "mixture", "mode_settings"])
@pytest.mark.parametrize(
    "value",
    [
        _deep(100_000),
        10**5000,
        -(10**5000),
        "x" * 10_000_000,
        float("nan"),
        [{"weight": _deep(50_000)}],
    ],
    ids=["deep", "huge-int", "huge-negative", "10MB-string", "nan", "deep-weight"],
)
def test_loader_state_oversized_values_give_a_short_clear_error(saved_state, target, key, value):
    state = dict(saved_state, **{key: value})
    with pytest.raises(LoaderStateError) as err:
        target.load_state_dict(state)
    assert len(str(err.value)) < 2000  # the message stays readable: values are abbreviated


@FUZZ
@given(data=st.data())
def test_fuzz_loader_state_truncated_to_some_keys(saved_state, target, data):
    """A state that lost keys (a truncated record re-closed, an older writer): refused with
    the missing field named, or loaded sanely."""
    keys = data.draw(st.permutations(sorted(saved_state)))
    kept = data.draw(st.integers(0, len(keys)))
    _load(target, {k: saved_state[k] for k in keys[:kept]})


def test_loader_state_missing_a_cursor_field_names_it(saved_state, target):
    for key in ("step", "micro_in_step", "position", "global_batch"):
        state = {k: v for k, v in saved_state.items() if k != key}
        with pytest.raises(LoaderStateError, match=key):
            target.load_state_dict(state)


# -- the cache's stamps ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "stamp",
    ["garbage", "a b c d", "1 2 3", "", "fifo", "dir", "devzero", "huge", "nonascii", "digits"],
)
def test_bad_cache_stamp_is_skipped_and_the_entry_checked(dataset, tmp_path, stamp):
    store = Store(dataset)
    manifest = read_manifest(store)
    s = manifest.shards[0]
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    cache.local_path(s.name, s.bytes, s.checksum)
    stamp_path = cache._stamp_path(s.name)
    os.unlink(stamp_path)
    if stamp == "fifo":
        os.mkfifo(stamp_path)
    elif stamp == "dir":
        os.mkdir(stamp_path)
    elif stamp == "devzero":
        os.symlink("/dev/zero", stamp_path)
    elif stamp == "huge":
        with open(stamp_path, "wb") as f:
            f.truncate(1 << 30)
    elif stamp == "nonascii":
        open(stamp_path, "wb").write(
            "١٢ ٣ ٤ xxh3_64:0".encode()
        )  # unicode digits: int() takes them
    elif stamp == "digits":
        open(stamp_path, "w").write("1 2 3 xxh3_64:0000000000000000\n")  # well formed, wrong
    else:
        open(stamp_path, "w").write(stamp)
    fresh = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    path = fresh.local_path(s.name, s.bytes, s.checksum)  # no hang, no raise
    assert file_checksum(path) == s.checksum
    assert fresh.metrics()["downloads"] == 0  # the copy was sound: checksummed, kept
    assert fresh.metrics()["bad_stamps"] == (0 if stamp == "digits" else 1)  # counted


def test_cache_entry_replaced_by_a_link_or_fifo_is_refetched(dataset, tmp_path):
    store = Store(dataset)
    manifest = read_manifest(store)
    s = manifest.shards[0]
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    path = cache.local_path(s.name, s.bytes, s.checksum)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * s.bytes)  # right size, wrong bytes
    os.unlink(path)
    os.symlink(outside, path)
    fresh = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    got = fresh.local_path(s.name, s.bytes, s.checksum)
    assert not os.path.islink(got) and file_checksum(got) == s.checksum
    assert fresh.metrics()["downloads"] == 1
    assert outside.read_bytes() == b"\0" * s.bytes  # the link's target was not touched


@pytest.mark.parametrize("step, position", [(1 << 40, 1 << 40), (1 << 40, 0), (0, 1 << 40)])
def test_loader_state_at_the_cursor_bounds_serves_a_batch(saved_state, target, step, position):
    """The largest accepted cursor still maps to valid samples (no int64 overflow)."""
    _load(target, dict(saved_state, step=step, position=position, micro_in_step=0))
    assert target.state_dict()["step"] in (step, step + 1)


@pytest.mark.parametrize("key", ["step", "position"])
def test_loader_state_past_the_cursor_bounds_is_refused(saved_state, target, key):
    with pytest.raises(LoaderStateError, match=f"{key}=.*beyond any run"):
        target.load_state_dict(dict(saved_state, **{key: (1 << 40) + 1}))
