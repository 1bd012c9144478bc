"""``steadytrain shuffle``: the output read in order is the input's samples, shuffled."""

from __future__ import annotations

import json

import numpy as np
import pytest

from steadytrain.cli import main
from steadytrain.data.ingest.shuffle import SHUFFLE_PURPOSE
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.data.read.permute import Feistel, derive_key
from steadytrain.data.read.sampler import Sampler


def test_shuffle_writes_every_sample_once_in_keyed_order(ds_a, tmp_path, capsys):
    out = str(tmp_path / "shuffled")
    rc = main(
        [
            "shuffle",
            ds_a.url,
            "--out",
            out,
            "--seq-len",
            "16",
            "--seed",
            "3",
            "--windows-per-shard",
            "7",
            "--json",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == 40 and summary["num_shards"] == 6  # ceil(40 / 7)
    shuffled = TokenDataset.open(out)
    assert shuffled.manifest.extra["shuffled"]["source"] == ds_a.fingerprint
    assert summary["fingerprint"] == shuffled.fingerprint
    src = Sampler([ds_a], 16, 1, mode="sequential")
    dst = Sampler([shuffled], 16, 1, mode="sequential")
    assert dst.num_samples == [40]
    perm = Feistel(40, derive_key(3, SHUFFLE_PURPOSE))(np.arange(40))
    a, b = src.locate(perm), dst.locate(np.arange(40))
    last_in_shard = np.r_[np.diff(b.shard) != 0, True]
    for j in range(40):
        want = np.asarray(ds_a.tokens(int(a.shard[j]))[a.offset[j] : a.offset[j] + 17])
        got = np.asarray(shuffled.tokens(int(b.shard[j]))[b.offset[j] : b.offset[j] + 17])
        assert np.array_equal(got[:16], want[:16])  # inputs exact
        if last_in_shard[j]:
            assert got[16] == want[16]  # and the shard's last label
    # Read with the loader in sequential mode: the stream is the input, shuffled.
    with TokenLoader(shuffled, 16, 8, 8, shuffle="sequential") as ld:
        ids = [next(ld)["input_ids"] for _ in range(5)]
    assert ids[0].shape == (8, 16)
    # Documents boundaries inside windows survive: an EOS ends a document in the index.
    for s in range(shuffled.num_shards):
        ends = np.asarray(shuffled.doc_ends(s), dtype=np.int64)
        toks = np.asarray(shuffled.tokens(s))
        inner = ends[(ends % 16 != 0) & (ends < toks.size)]
        assert (toks[inner - 1] == 0).all()


def test_shuffle_cli_errors_name_the_problem(ds_a, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["shuffle", missing, "--out", str(tmp_path / "o"), "--seq-len", "16"]) == 2
    assert f"{missing}/manifest.json does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shuffle", ds_a.url])  # --out and --seq-len are required
    assert main(["shuffle", ds_a.url, "--out", str(tmp_path / "o2"), "--seq-len", "1000"]) == 2
    assert "seq_len=1000" in capsys.readouterr().err
    assert not (tmp_path / "o2" / "manifest.json").exists()


def test_shuffle_copies_the_stored_tokenizer_so_the_output_verifies(tmp_path, capsys):
    """A dataset tokenized with a tokenizer.json names that file in its manifest; the
    shuffled copy must hold it too, or ``verify`` fails on the copy."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from steadytrain.data.ingest.tokenize import tokenize
    from steadytrain.data.ingest.verify import verify_dataset

    text = tmp_path / "docs.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"]))
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    src = tmp_path / "ds"
    res = tokenize([str(text)], str(src), tokenizer=str(tok_path), shard_tokens=512, workers=0)
    assert res.manifest.tokenizer.get("file") == "tokenizer.json"
    out = tmp_path / "shuffled"
    assert main(["shuffle", str(src), "--out", str(out), "--seq-len", "8"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    report = verify_dataset(str(out))
    assert report.ok, report.problems
    # A source whose manifest names a tokenizer file it lacks is refused before any manifest.
    (src / "tokenizer.json").unlink()
    bad_out = tmp_path / "shuffled2"
    assert main(["shuffle", str(src), "--out", str(bad_out), "--seq-len", "8"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert not (bad_out / "manifest.json").exists()
