"""Hostile data (issue 25, data wing): files that are not what the manifest claims, inputs
whose text column is not text, a moved document boundary. Each gets a clear error naming the
file (and the CLI exit 2), never a raw numpy/pyarrow/gzip traceback or silent acceptance."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from steadytrain.cli import main
from steadytrain.data.ingest.verify import verify_dataset
from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.format import ShardInfo, compute_fingerprint, read_manifest
from steadytrain.data.read.loader import TokenLoader
from steadytrain.errors import DatasetError, LoaderStateError
from steadytrain.storage.publish import canonical_digest
from steadytrain.storage.store import Store

SHARD0 = "shards/shard-00000.tokens"
INDEX0 = "shards/shard-00000.idx"
VOCAB, EOS, SEQ = 300, 299, 8


def _write(root: str, *, docs: int = 12, shard_tokens: int = 40) -> str:
    """A small dataset: ``docs`` documents of 9 ids in [1, 299) plus EOS, several shards."""
    rng = np.random.default_rng(0)
    with DatasetWriter(
        root, vocab_size=VOCAB, eos_id=EOS, tokenizer={"type": "test"}, shard_tokens=shard_tokens
    ) as w:
        for _ in range(docs):
            w.add_document(np.r_[rng.integers(1, EOS, size=9), EOS])
    return root


@pytest.fixture
def ds(tmp_path) -> str:
    return _write(str(tmp_path / "ds"))


def _edit_manifest(ds: str, mutate, *, refingerprint: bool = True) -> None:
    """Edit manifest.json; with ``refingerprint``, make its fingerprint consistent again (an
    attacker or a careless tool that "fixed" the checksums)."""
    path = os.path.join(ds, "manifest.json")
    obj = json.load(open(path))
    mutate(obj)
    if refingerprint:  # format.md A.4, scheme 2, computed here from the spec, not the reader
        canonical = {
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
        obj["fingerprint"] = canonical_digest(canonical)
    with open(path, "w") as f:
        json.dump(obj, f)


# -- row 1: files are what they claim -------------------------------------------------------
def test_symlinked_shard_outside_the_dataset_is_refused_at_open(ds, tmp_path):
    shard = os.path.join(ds, SHARD0)
    outside = tmp_path / "elsewhere.tokens"
    outside.write_bytes(open(shard, "rb").read())  # same size and bytes: only the link is wrong
    os.unlink(shard)
    os.symlink(outside, shard)
    with pytest.raises(DatasetError) as err:
        TokenDataset.open(ds)
    msg = str(err.value)
    assert shard in msg and "outside the dataset" in msg and "steadytrain verify" in msg
    assert main(["inspect", ds]) == 2  # the CLI too: exit 2 naming the file


def test_verify_reports_a_link_leaving_the_dataset_and_never_reads_a_fifo(ds, tmp_path, capsys):
    shard = os.path.join(ds, SHARD0)
    outside = tmp_path / "elsewhere.tokens"
    outside.write_bytes(open(shard, "rb").read())  # the checksum alone would pass it
    os.unlink(shard)
    os.symlink(outside, shard)
    probs = [str(p) for p in verify_dataset(ds).problems]
    assert len(probs) == 1 and SHARD0 in probs[0] and "outside the dataset" in probs[0]
    assert main(["verify", ds, "--quiet"]) == 1
    assert SHARD0 in capsys.readouterr().err
    # a FIFO listed as an empty shard (0 tokens, 0 docs): a read would block forever
    os.unlink(shard)
    os.mkfifo(shard)
    open(os.path.join(ds, INDEX0), "wb").close()

    def empty_shard(o):
        o["shards"][0].update(tokens=0, bytes=0, docs=0)
        o["shards"][0]["index"]["bytes"] = 0

    _edit_manifest(ds, empty_shard)
    probs = [str(p) for p in verify_dataset(ds).problems]
    assert any(SHARD0 in p and "not a regular file" in p for p in probs)


def test_symlink_inside_the_dataset_still_opens(ds):
    shard = os.path.join(ds, SHARD0)
    os.rename(shard, os.path.join(ds, "shards", "moved.tokens"))
    os.symlink("moved.tokens", shard)  # relative, stays inside the dataset
    assert TokenDataset.open(ds).tokens(0).size == read_manifest(Store(ds)).shards[0].tokens


def test_fifo_in_place_of_an_index_is_refused_without_reading_it(ds):
    index = os.path.join(ds, INDEX0)
    os.unlink(index)
    os.mkfifo(index)  # a read would block forever
    with pytest.raises(DatasetError, match="not a regular file") as err:
        TokenDataset.open(ds)
    assert index in str(err.value)


def _poke(ds: str, offset: int, value: int) -> None:
    path = os.path.join(ds, SHARD0)
    toks = np.fromfile(path, dtype="<u2")
    toks[offset] = value
    toks.tofile(path)  # same size: open's cheap checks pass, only the id is wrong


@pytest.mark.parametrize("num_workers", [0, 1])
def test_out_of_vocab_token_names_the_shard_and_offset(ds, num_workers):
    _poke(ds, 5, 60000)  # vocab is 300; uint16 holds it
    loader = TokenLoader(
        TokenDataset.open(ds),
        seq_len=SEQ,
        global_batch=2,
        micro_batch=2,
        shuffle="sequential",
        num_workers=num_workers,
    )
    with loader, pytest.raises(DatasetError) as err:
        for _ in range(20):  # sample 0 of shard 0 holds token 5: the first micro-batch
            next(loader)
    msg = str(err.value)
    assert SHARD0 in msg and "token id 60000" in msg and "token offset 5" in msg
    assert f"[0, {VOCAB})" in msg and "steadytrain verify" in msg


def test_in_vocab_data_reads_unchanged(ds):
    """The check costs nothing visible: ids below vocab_size pass and arrive intact."""
    data = TokenDataset.open(ds)
    loader = TokenLoader(
        data, seq_len=SEQ, global_batch=2, micro_batch=2, shuffle="sequential", num_workers=0
    )
    with loader:
        batch = next(loader)
    assert int(batch["input_ids"].max()) < VOCAB
    first = np.asarray(data.tokens(0))[:SEQ]
    assert batch["input_ids"][0].tolist() == first.tolist()


@pytest.mark.parametrize(
    "edit, needle",
    [
        # 10**18 tokens (with or without consistent bytes): refused before numpy's mmap
        (lambda s: s.update(tokens=10**18, bytes=2 * 10**18), "bytes=2" + "0" * 18 + " is outside"),
        (lambda s: s.update(tokens=10**18), "tokens=1" + "0" * 18 + " is outside"),
        # 10**12 tokens, the real byte count: the sizes contradict each other
        (lambda s: s.update(tokens=10**12), "bytes for 1000000000000 tokens"),
        # a plausible but wrong size: the file on disk disagrees
        (lambda s: s.update(tokens=s["tokens"] + 4, bytes=s["bytes"] + 8), "the manifest says"),
    ],
)
def test_manifest_with_absurd_token_count_gives_a_clear_error(ds, capsys, edit, needle):
    _edit_manifest(ds, lambda o: edit(o["shards"][0]))
    with pytest.raises(DatasetError, match=needle) as err:
        TokenDataset.open(ds)
    assert "shard-00000.tokens" in str(err.value) and "Traceback" not in str(err.value)
    assert main(["inspect", ds]) == 2
    assert "shard-00000.tokens" in capsys.readouterr().err
    assert main(["verify", ds, "--quiet"]) == 1


@pytest.mark.parametrize("dtype", ["uint32", "float32", "int64"])
def test_manifest_with_another_dtype_gives_a_clear_error(ds, capsys, dtype):
    _edit_manifest(ds, lambda o: o.update(dtype=dtype))
    with pytest.raises(DatasetError) as err:
        TokenDataset.open(ds)
    msg = str(err.value)
    assert "manifest.json" in msg
    assert ("bytes for" in msg and "4 bytes each" in msg) if dtype == "uint32" else "dtype" in msg
    assert main(["inspect", ds]) == 2
    assert "manifest.json" in capsys.readouterr().err


# -- row 2: tokenize inputs whose text is not text ------------------------------------------
def _parquet(path, column) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column}), str(path))
    return str(path)


@pytest.mark.parametrize(
    "column, kind",
    [
        ([1, 2, 3], "int64"),
        ([["a", "b"], ["c"]], "list"),
        ([{"a": "x"}, {"a": "y"}], "struct"),
    ],
)
def test_parquet_text_column_of_another_type_exits_2_naming_file_and_column(
    tmp_path, capsys, column, kind
):
    src = _parquet(tmp_path / "in.parquet", column)
    out = tmp_path / "ds"
    code = main(["tokenize", src, "--out", str(out), "--workers", "0", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert src in err and "'text'" in err and kind in err and "--text-field" in err
    assert "Traceback" not in err and not out.exists()  # nothing half-written


def test_truncated_jsonl_gz_exits_2_naming_the_file(tmp_path, capsys):
    whole = gzip.compress(
        b"".join(json.dumps({"text": f"document {i} " * 50}).encode() + b"\n" for i in range(200))
    )
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "ds"
    for workers in ("0", "2"):
        code = main(["tokenize", str(src), "--out", str(out), "--workers", workers, "--quiet"])
        err = capsys.readouterr().err
        assert code == 2
        assert str(src) in err and "truncated" in err and "Traceback" not in err
        assert not out.exists()


def test_binary_parquet_column_counts_its_replacements(tmp_path, capsys):
    src = _parquet(tmp_path / "in.parquet", [b"caf\xe9 ok", b"fine", b"\xff\xfe x \xff"])
    out = tmp_path / "ds"
    code = main(["tokenize", src, "--out", str(out), "--workers", "0", "--quiet", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    info = json.loads(captured.out)
    assert "2 value(s) not valid UTF-8" in captured.err
    # b"caf\xe9 ok" -> 1 replacement; b"\xff\xfe x \xff" -> 3 (one per invalid byte)
    assert info["replacements"] == 4 and info["replaced_files"] == 1
    extra = read_manifest(Store(str(out))).extra["input"]
    assert extra["replacements"] == 4 and extra["replaced_files"] == 1


# -- row 3: the fingerprint covers the document index ---------------------------------------
def _move_boundary(ds: str) -> None:
    """Move the first document end of shard 0 by one token, with the index checksum updated
    in the manifest (what an edit that "keeps the dataset consistent" does)."""
    path = os.path.join(ds, INDEX0)
    ends = np.fromfile(path, dtype="<u8")
    ends[0] += 1
    ends.tofile(path)
    from steadytrain.storage.publish import checksum_bytes

    _edit_manifest(
        ds,
        lambda o: o["shards"][0]["index"].update(checksum=checksum_bytes(ends.tobytes())),
        refingerprint=False,
    )


def test_moved_document_boundary_fails_verify(ds, capsys):
    _move_boundary(ds)
    report = verify_dataset(ds)
    assert not report.ok and "fingerprint" in str(report.problems[0])
    assert main(["verify", ds, "--quiet"]) == 1
    with pytest.raises(DatasetError, match="fingerprint"):
        TokenDataset.open(ds)


def test_moved_document_boundary_changes_the_fingerprint_and_resume_refuses(ds):
    before = TokenDataset.open(ds)
    loader = TokenLoader(before, seq_len=SEQ, global_batch=2, micro_batch=2, num_workers=0)
    with loader:
        next(loader)
        state = loader.state_dict()
    _move_boundary(ds)
    _edit_manifest(ds, lambda o: None)  # and the fingerprint recomputed: a new dataset
    after = TokenDataset.open(ds)
    assert verify_dataset(ds).ok
    assert after.fingerprint != before.fingerprint
    resumed = TokenLoader(after, seq_len=SEQ, global_batch=2, micro_batch=2, num_workers=0)
    with pytest.raises(LoaderStateError, match="dataset fingerprint"):
        resumed.load_state_dict(state)


def _as_legacy(ds: str) -> str:
    """Rewrite the manifest as a dataset written before the fingerprint covered the index."""

    def legacy(o):
        o.pop("fingerprint_version", None)
        shards = [ShardInfo.from_json(s, where="test") for s in o["shards"]]
        o["fingerprint"] = compute_fingerprint(
            o["dtype"], o["vocab_size"], o["eos_id"], shards, scheme=1
        )

    _edit_manifest(ds, legacy, refingerprint=False)
    return read_manifest(Store(ds)).fingerprint


def test_legacy_manifest_still_opens_and_keeps_its_fingerprint(ds):
    old_fp = _as_legacy(ds)
    data = TokenDataset.open(ds)
    assert data.fingerprint == old_fp and data.manifest.fingerprint_version == 1
    assert verify_dataset(ds).ok
    # re-serialised, a legacy manifest stays legacy (no key added, same fingerprint)
    assert "fingerprint_version" not in data.manifest.to_json()


def test_state_saved_with_a_legacy_fingerprint_gets_a_clear_message(ds, tmp_path):
    """A loader state saved against the legacy fingerprint of the same tokens is refused
    with a message saying so (the document split may differ), not accepted silently."""
    new = TokenDataset.open(ds)
    legacy_copy = _write(str(tmp_path / "legacy"))
    old_fp = _as_legacy(legacy_copy)
    old = TokenDataset.open(legacy_copy)
    with TokenLoader(old, seq_len=SEQ, global_batch=2, micro_batch=2, num_workers=0) as lo:
        next(lo)
        state = lo.state_dict()
    assert state["fingerprint"] == old_fp != new.fingerprint
    resumed = TokenLoader(new, seq_len=SEQ, global_batch=2, micro_batch=2, num_workers=0)
    with pytest.raises(LoaderStateError) as err:
        resumed.load_state_dict(state)
    msg = str(err.value)
    assert "legacy" in msg and "document" in msg and "allow_dataset_change=True" in msg
    ok = TokenLoader(
        new, seq_len=SEQ, global_batch=2, micro_batch=2, num_workers=0, allow_dataset_change=True
    )
    ok.load_state_dict(state)  # the documented way through, for whoever checked the data
    assert ok.step == 1


def test_verify_notes_a_legacy_fingerprint(ds, capsys):
    _as_legacy(ds)
    assert main(["verify", ds, "--quiet"]) == 0  # sound: still accepted
    err = capsys.readouterr().err
    assert "legacy (scheme 1) fingerprint" in err and "re-tokenize" in err
    assert main(["verify", ds, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint_version"] == 1


def test_tokenize_onto_a_legacy_dataset_of_the_same_content_is_up_to_date(tmp_path):
    from steadytrain.data.ingest.tokenize import tokenize

    src = tmp_path / "in.txt"
    src.write_text("hello legacy world\n" * 20)
    dest = str(tmp_path / "ds")
    tokenize([str(src)], dest, workers=0)
    old_fp = _as_legacy(dest)
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new recipe:
    again = tokenize([str(src)], dest, workers=0)  # re-read, then compared by content
    assert again.up_to_date and again.manifest.fingerprint == old_fp
    src.write_text("other content\n")
    with pytest.raises(DatasetError, match="different dataset"):
        tokenize([str(src)], dest, workers=0)


def test_shuffle_of_out_of_vocab_data_exits_2_naming_the_shard(ds, tmp_path, capsys):
    _poke(ds, 5, 60000)
    out = tmp_path / "shuffled"
    assert main(["shuffle", ds, "--out", str(out), "--seq-len", str(SEQ)]) == 2
    err = capsys.readouterr().err
    assert "token id 60000" in err and SHARD0 in err and "steadytrain verify" in err
    assert not (out / "manifest.json").exists()
