"""Dataset format v1: manifest validation, writer invariants, fingerprint definition."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xxhash

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.format import Manifest, compute_fingerprint, read_manifest
from steadytrain.errors import DatasetError
from steadytrain.storage.store import Store


def _write(dest, docs, vocab=300, eos=299, shard_tokens=10) -> Manifest:
    with DatasetWriter(str(dest), vocab_size=vocab, eos_id=eos, tokenizer={"type": "test"},
                       shard_tokens=shard_tokens) as w:  # fmt: skip
        for d in docs:
            w.add_document(np.array(list(d) + [eos]))
    return read_manifest(Store(str(dest)))


def test_shards_close_at_document_boundaries(tmp_path):
    docs = [[1] * 4, [2] * 9, [3] * 2, [4] * 30, [5]]
    m = _write(tmp_path / "ds", docs)
    assert [s.tokens for s in m.shards] == [15, 34, 2]  # each shard >= 10 tokens except the last
    assert m.num_docs == len(docs) and m.num_tokens == sum(len(d) + 1 for d in docs)
    ends = np.fromfile(tmp_path / "ds" / m.shards[0].index_name, dtype="<u8")
    assert ends.tolist() == [5, 15]


def test_fingerprint_is_the_documented_canonical_json(tmp_path):
    m = _write(tmp_path / "ds", [[1, 2, 3]])
    canonical = json.dumps(
        {
            "dtype": "uint16",
            "eos_id": 299,
            "fingerprint_version": 2,
            "format": "steadytrain.tokens",
            "shards": [[s.tokens, s.docs, s.checksum, s.index_checksum] for s in m.shards],
            "version": 1,
            "vocab_size": 300,
        },
        separators=(",", ":"),
    )
    assert m.fingerprint_version == 2
    assert m.fingerprint == xxhash.xxh3_128_hexdigest(canonical.encode())
    data = (tmp_path / "ds" / m.shards[0].name).read_bytes()
    assert data == np.array([1, 2, 3, 299], dtype="<u2").tobytes()
    assert m.shards[0].checksum == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)
    assert m.fingerprint == compute_fingerprint("uint16", 300, 299, list(m.shards))


def test_uint32_when_vocab_exceeds_uint16(tmp_path):
    m = _write(tmp_path / "ds", [[70000, 1]], vocab=70001, eos=70000)
    assert m.dtype == "uint32"
    assert np.fromfile(tmp_path / "ds" / m.shards[0].name, dtype="<u4").tolist() == [
        70000,
        1,
        70000,
    ]


def test_writer_rejects_ids_beyond_vocab(tmp_path):
    with pytest.raises(DatasetError, match="token id 400 outside the vocabulary"):
        _write(tmp_path / "ds", [[400]])
    assert not os.path.exists(tmp_path / "ds" / "manifest.json")


def test_exception_inside_writer_leaves_no_manifest_nor_shard(tmp_path):
    with pytest.raises(RuntimeError):
        with DatasetWriter(str(tmp_path / "ds"), vocab_size=10, eos_id=9, tokenizer={}) as w:
            w.add_document(np.array([1, 2, 9]))
            raise RuntimeError("crash")
    assert os.listdir(tmp_path / "ds" / "shards") == []
    assert not os.path.exists(tmp_path / "ds" / "manifest.json")


def _base_manifest(tmp_path) -> dict:
    _write(tmp_path / "ds", [[1, 2]])
    return json.loads((tmp_path / "ds" / "manifest.json").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"version": 2}, "format version 2 is not supported"),
        ({"version": "1"}, "format version '1' is not supported"),
        ({"format": "other"}, "is not 'steadytrain.tokens'"),
        ({"dtype": "int64"}, "dtype 'int64' is not one of"),
        ({"byte_order": "big"}, "byte_order must be 'little'"),
        ({"eos_id": 300}, "eos_id 300 outside the vocabulary"),
        ({"vocab_size": 70000}, "cannot hold vocab_size 70000"),
        ({"shards": {}}, "'shards' must be a list"),
    ],
)
def test_manifest_validation_names_the_problem(tmp_path, edit, message):
    obj = _base_manifest(tmp_path)
    obj.update(edit)
    with pytest.raises(DatasetError, match=message) as err:
        Manifest.from_json(obj, where="somewhere/manifest.json")
    assert "somewhere/manifest.json" in str(err.value)


@pytest.mark.parametrize("name", ["../x.tokens", "/abs/x.tokens", "a/../../x", "C:/x", "a\\b"])
def test_escaping_or_odd_shard_names_are_refused(tmp_path, name):
    obj = _base_manifest(tmp_path)
    obj["shards"][0]["name"] = name
    with pytest.raises(DatasetError, match="shard name"):
        Manifest.from_json(obj, where="m.json")
    obj["shards"][0]["name"] = "shards/shard-00000.tokens"
    obj["shards"][0]["index"]["name"] = name
    with pytest.raises(DatasetError, match="index name"):
        Manifest.from_json(obj, where="m.json")


def test_duplicate_file_names_are_refused(tmp_path):
    obj = _base_manifest(tmp_path)
    obj["shards"].append(dict(obj["shards"][0]))
    with pytest.raises(DatasetError, match="share a file name"):
        Manifest.from_json(obj, where="m.json")


def test_manifest_not_json(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text("{half")
    with pytest.raises(DatasetError, match="not valid JSON"):
        read_manifest(Store(str(tmp_path / "ds")))
