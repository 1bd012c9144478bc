"""Fuzzers for the checkpoint wing's readers of untrusted files (issue 25, item 6): the COMMIT
manifest (``commit.parse_commit``, then ``verify_local`` and the ``checkpoints`` listing) and
the writer lease (``lease._generations``, ``lease._read``, ``lease.acquire``).

Inputs start from real files written by ``Checkpointer`` and are mutated (bytes flipped,
inserted, cut), type-swapped (a field replaced by any JSON value, then resealed so that the
checksum passes and the schema must catch it) and oversized. Each asserts only the error
type the module documents escapes (``CheckpointError``), and that what is accepted is sane.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadytrain.checkpoint import lease as L
from steadytrain.checkpoint.commit import commit_schema, parse_commit, seal, verify_local
from steadytrain.checkpoint.inspect import list_checkpoints
from steadytrain.errors import CheckpointError
from steadytrain.storage.store import Store

sys.path.insert(0, os.path.dirname(__file__))

from test_checkpoint_commit import _save_steps  # noqa: E402

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)  # NaN and inf cannot be written as JSON by json.dumps(strict)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[pathlib.Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("real")
    _save_steps(root, [2])
    d = root / "step-00000002"
    return d, json.loads((d / "COMMIT").read_text())


def _mutate_bytes(raw: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    data = bytearray(raw)
    for kind, at, value in ops:
        if not data:
            break
        at %= len(data)
        if kind == 0:
            data[at] ^= 1 << (value % 8)  # one flipped bit
        elif kind == 1:
            data.insert(at, value % 256)
        elif kind == 2:
            del data[at:]  # truncated
        else:
            data[at] = value % 256
    return bytes(data)


def _swap(doc: dict, where: list[str | int], value: Any) -> dict:
    """``doc`` with the field at path ``where`` (followed as far as it goes) set to ``value``."""
    out = json.loads(json.dumps(doc))
    node: Any = out
    for i, key in enumerate(where):
        last = i == len(where) - 1
        if isinstance(node, dict) and node:
            k = sorted(node)[key % len(node)] if isinstance(key, int) else key
            if last or not isinstance(node.get(k), (dict, list)):
                node[k] = value
                return out
            node = node[k]
        elif isinstance(node, list) and node:
            j = (key if isinstance(key, int) else 0) % len(node)
            if last or not isinstance(node[j], (dict, list)):
                node[j] = value
                return out
            node = node[j]
    return out


def _check_accepted(doc: Any) -> None:
    """What parse_commit accepts satisfies docs/format.md part D."""
    assert isinstance(doc, dict) and commit_schema(doc) is None
    assert type(doc["step"]) is int and doc["step"] >= 0
    assert type(doc["tokens_seen"]) is int and doc["tokens_seen"] >= 0
    assert all(type(f["size"]) is int and f["size"] >= 0 for f in doc["files"])
    assert doc["total_bytes"] == sum(f["size"] for f in doc["files"])


def _only_checkpoint_errors(directory: pathlib.Path, raw: bytes) -> None:
    try:
        doc = parse_commit(raw, str(directory))
    except CheckpointError as exc:
        assert str(directory) in str(exc), "the error names the checkpoint"
        return
    _check_accepted(doc)
    try:
        verify_local(str(directory), doc)
    except CheckpointError:
        pass


ops = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 255)), max_size=6)


@FUZZ
@given(ops=ops)
def test_fuzz_commit_bytes_mutated_or_truncated(real, ops):
    d, doc = real
    _only_checkpoint_errors(d, _mutate_bytes((d / "COMMIT").read_bytes(), ops))


paths = st.lists(st.one_of(st.integers(0, 20), st.sampled_from(["world", "files"])), max_size=4)


@FUZZ
@given(where=paths, value=json_values, resealed=st.booleans())
def test_fuzz_commit_fields_type_swapped(real, where, value, resealed):
    d, doc = real
    bad = _swap(doc, where or [0], value)
    raw = json.dumps(seal(bad) if resealed else bad).encode()
    _only_checkpoint_errors(d, raw)


@FUZZ
@given(
    field=st.sampled_from(["step", "tokens_seen", "total_bytes", "block_s", "wall_time"]),
    big=st.one_of(st.integers(2**63, 10**40), st.floats(1e300, 1e308)),
    files=st.integers(0, 3000),
)
def test_fuzz_commit_oversized_values_and_lists(real, field, big, files):
    d, doc = real
    bad = json.loads(json.dumps(doc))
    bad[field] = big
    bad["files"] = bad["files"] + [
        {"path": f"x{i}.bin", "size": 1, "xxh3_64": "0" * 16, "rank": 0} for i in range(files)
    ]
    _only_checkpoint_errors(d, json.dumps(seal(bad)).encode())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops)
def test_fuzz_the_listing_never_stops_on_a_mutated_commit(real, ops):
    """The listing (``steadytrain checkpoints``) over a mutated COMMIT: one row, never an
    exception; committed only when the bytes still verify."""
    d, _ = real
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp) / d.name
        shutil.copytree(d, copy)
        (copy / "COMMIT").write_bytes(_mutate_bytes((d / "COMMIT").read_bytes(), ops))
        rows = list_checkpoints(tmp)
    assert len(rows) == 1 and rows[0]["state"] in ("committed", "damaged")
    assert rows[0]["verifies"] == (rows[0]["error"] is None)


# -- the writer lease ---------------------------------------------------------------------


def _real_lease(tmp: pathlib.Path) -> bytes:
    lease = L.acquire(Store(str(tmp)), job="fuzz-writer")
    lease.release()
    return (tmp / L.LEASE_DIR / f"{lease.generation:08d}.json").read_bytes()


@pytest.fixture(scope="module")
def lease_bytes(tmp_path_factory) -> bytes:
    return _real_lease(tmp_path_factory.mktemp("lease"))


tricky = ["²", "٣٣٣٣٣٣٣٣", "1", "000000001", "00000001", "00000001.json", "0000000x", "-0000001"]
names = st.one_of(
    st.sampled_from(tricky),
    st.text(
        alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="/\x00"),
        min_size=1,
        max_size=14,
    ),
).map(lambda s: s + ".json")


@FUZZ
@given(bad=st.lists(names, max_size=5))
def test_fuzz_lease_file_names_never_stop_a_start(bad):
    with tempfile.TemporaryDirectory() as tmp:
        lease_dir = pathlib.Path(tmp) / L.LEASE_DIR
        lease_dir.mkdir()
        for name in bad:
            if name not in (".json", "..json"):
                (lease_dir / name).write_text("{}")
        gens = L._generations(Store(tmp))
        assert all(f"{g:08d}.json" in bad for g in gens), "only exact GGGGGGGG.json names"
        _acquire_only_checkpoint_errors(tmp)


def _acquire_only_checkpoint_errors(tmp: str) -> None:
    try:
        lease = L.acquire(Store(tmp), job="fuzz-me", timeout_s=300.0)
    except CheckpointError:
        return  # a live holder, or a newer lease version: refused with the fix
    try:
        assert (pathlib.Path(tmp) / L.LEASE_DIR / f"{lease.generation:08d}.json").is_file()
    finally:
        lease.release()


@FUZZ
@given(ops=ops)
def test_fuzz_lease_record_bytes_mutated(lease_bytes, ops):
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp) / L.LEASE_DIR
        d.mkdir()
        (d / "00000007.json").write_bytes(_mutate_bytes(lease_bytes, ops))
        try:
            rec = L._read(Store(tmp), 7)
        except CheckpointError as exc:
            assert "upgrade steadytrain" in str(exc) and "00000007.json" in str(exc)
        else:
            assert isinstance(rec, dict)
        _acquire_only_checkpoint_errors(tmp)


@FUZZ
@given(key=st.integers(0, 30), value=json_values)
def test_fuzz_lease_record_fields_type_swapped(lease_bytes, key, value):
    rec = json.loads(lease_bytes)
    rec.update(released=False, job="someone-else", heartbeat=1e12)  # a live-looking holder
    field = sorted(rec)[key % len(rec)]
    rec[field] = value
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp) / L.LEASE_DIR
        d.mkdir()
        (d / "00000003.json").write_text(json.dumps(rec))
        try:
            got = L._read(Store(tmp), 3)
        except CheckpointError as exc:
            assert field == "version" and "upgrade steadytrain" in str(exc)
        else:
            assert got is not None and (got.get("unreadable") or L._record_problem(got) is None)
        _acquire_only_checkpoint_errors(tmp)
