"""Megatron-LM .bin/.idx import, against a pair this test writes in Megatron's layout."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from steadytrain.cli import main
from steadytrain.data.ingest.megatron import import_megatron
from steadytrain.data.ingest.verify import verify_dataset
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.errors import ConfigError, DatasetError

CODES = {np.uint8: 1, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix, sequences, doc_starts, dtype, modes=False) -> None:
    """The MMapIndexedDataset layout: header, i32 lengths, i64 byte pointers, i64 doc index."""
    dtype = np.dtype(dtype)
    with open(f"{prefix}.bin", "wb") as f:
        for seq in sequences:
            f.write(np.asarray(seq, dtype=dtype).tobytes())
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64))) * dtype.itemsize
    doc_idx = np.array(list(doc_starts) + [len(sequences)], dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype.type]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.tobytes())
        if modes:
            f.write(bytes(len(sequences)))


def _docs(url) -> list[list[int]]:
    ds = TokenDataset.open(url)
    toks, ends = np.asarray(ds.tokens(0)), np.asarray(ds.doc_ends(0))
    return [toks[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends, strict=True)]


EOD = 50


@pytest.mark.parametrize("dtype, out_dtype", [(np.uint16, "uint16"), (np.int32, "uint32")])
def test_uint16_and_int32_are_hardlinked_not_rewritten(tmp_path, dtype, out_dtype):
    prefix = str(tmp_path / "corpus_text_document")
    seqs = [[1, 2, 3, EOD], [4, 5, EOD], [6, EOD]]
    write_megatron(prefix, seqs, [0, 1, 2], dtype, modes=True)
    res = import_megatron(prefix, str(tmp_path / "ds"))
    m = res.manifest
    assert res.linked and m.dtype == out_dtype and m.eos_id == EOD and m.vocab_size == EOD + 1
    shard = tmp_path / "ds" / m.shards[0].name
    assert os.stat(shard).st_ino == os.stat(f"{prefix}.bin").st_ino  # same file, no copy
    assert _docs(str(tmp_path / "ds")) == seqs
    meg = m.extra["megatron"]
    assert meg["docs_end_with_eos"] and meg["hardlinked"] and meg["sequences"] == 3
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_int64_is_converted_and_multi_sequence_documents_kept(tmp_path):
    prefix = str(tmp_path / "c")
    # 4 sequences, documents = [seq0 + seq1], [] (empty), [seq2 + seq3]; no EOD tokens.
    seqs = [[1, 2], [3], [4, 5, 6], [7]]
    write_megatron(prefix, seqs, [0, 2, 2], np.int64)
    with pytest.raises(ConfigError, match="--eos-id"):
        import_megatron(prefix, str(tmp_path / "ds"))
    res = import_megatron(prefix, str(tmp_path / "ds"), eos_id=0, vocab_size=1000)
    m = res.manifest
    assert not res.linked and m.dtype == "uint16" and m.vocab_size == 1000
    assert _docs(str(tmp_path / "ds")) == [[1, 2, 3], [4, 5, 6, 7]]
    meg = m.extra["megatron"]
    assert meg["empty_docs_dropped"] == 1 and meg["docs_end_with_eos"] is False
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_same_tokens_give_the_same_fingerprint_as_tokenize_layout(tmp_path):
    """Imported uint16 data and the same ids written by the writer share a fingerprint."""
    from steadytrain.data.ingest.writer import DatasetWriter

    seqs = [[1, 2, EOD], [3, EOD]]
    write_megatron(str(tmp_path / "p"), seqs, [0, 1], np.uint16)
    a = import_megatron(str(tmp_path / "p"), str(tmp_path / "a")).manifest
    with DatasetWriter(str(tmp_path / "b"), vocab_size=EOD + 1, eos_id=EOD, tokenizer={}) as w:
        for s in seqs:
            w.add_document(np.array(s))
    b = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert a.fingerprint == b["fingerprint"]


def test_bad_magic_truncated_index_and_missing_files(tmp_path):
    prefix = str(tmp_path / "c")
    write_megatron(prefix, [[1, EOD]], [0], np.uint16)
    raw = open(f"{prefix}.idx", "rb").read()
    open(f"{prefix}.idx", "wb").write(raw[:-3])
    with pytest.raises(DatasetError, match=r"c\.idx: .* truncated"):
        import_megatron(prefix, str(tmp_path / "ds"))
    open(f"{prefix}.idx", "wb").write(b"NOTMAGIC!" + raw[9:])
    with pytest.raises(DatasetError, match="bad magic"):
        import_megatron(prefix, str(tmp_path / "ds"))
    with pytest.raises(DatasetError, match=r"nope\.bin does not exist"):
        import_megatron(str(tmp_path / "nope"), str(tmp_path / "ds"))
    assert not os.path.exists(tmp_path / "ds")


def test_truncated_bin_and_ids_beyond_vocab(tmp_path):
    prefix = str(tmp_path / "c")
    write_megatron(prefix, [[1, 2, EOD], [9, EOD]], [0, 1], np.uint16)
    with pytest.raises(DatasetError, match="token id 50 is outside the vocabulary"):
        import_megatron(prefix, str(tmp_path / "ds"), vocab_size=20, eos_id=2)
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(DatasetError, match=r"c\.bin: 4 bytes.*truncated"):
        import_megatron(prefix, str(tmp_path / "ds"))
    assert not os.path.exists(tmp_path / "ds")


def test_cli_from_megatron_json(tmp_path, capsys):
    prefix = str(tmp_path / "c")
    write_megatron(prefix, [[1, 2, EOD], [3, EOD]], [0, 1], np.uint16)
    dest = str(tmp_path / "ds")
    assert main(["tokenize", "--from-megatron", prefix, "--out", dest, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_tokens"] == 5 and out["num_docs"] == 2 and out["hardlinked"]
    assert main(["tokenize", "--from-megatron", prefix, "--out", dest, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"]
