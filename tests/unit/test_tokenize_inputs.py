"""tokenize: input formats, tokenizers, determinism, non-UTF-8, empty input, round trip."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from steadytrain.data.ingest import tokenize as tok_mod
from steadytrain.data.ingest.tokenize import tokenize
from steadytrain.data.ingest.verify import dataset_info, verify_dataset
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.errors import DatasetError

DOCS = ["hello world\n", "the second document, with ünïcødé ✓\n", "x" * 50, "last one"]


def _docs_of(url: str) -> list[list[int]]:
    ds = TokenDataset.open(url)
    out = []
    for s in range(ds.num_shards):
        toks = np.asarray(ds.tokens(s))
        start = 0
        for end in np.asarray(ds.doc_ends(s)):
            out.append(toks[start:end].tolist())
            start = int(end)
    return out


def _bytes_decode(doc: list[int]) -> str:
    assert doc[-1] == 256, "every document ends with EOS"
    assert 256 not in doc[:-1]
    return bytes(doc[:-1]).decode("utf-8")


def _write_texts(d, docs=DOCS) -> str:
    os.makedirs(d, exist_ok=True)
    for i, text in enumerate(docs):
        with open(os.path.join(d, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    return str(d)


def test_bytes_round_trip_text_dir(tmp_path):
    src = _write_texts(tmp_path / "in")
    res = tokenize([src], str(tmp_path / "ds"), workers=0)
    assert res.manifest.num_docs == len(DOCS)
    assert [_bytes_decode(d) for d in _docs_of(str(tmp_path / "ds"))] == DOCS
    assert res.manifest.vocab_size == 257 and res.manifest.eos_id == 256
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_jsonl_custom_field_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    pqf = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": DOCS, "n": list(range(len(DOCS)))}), pqf, row_group_size=2)
    res = tokenize([str(jl), str(pqf)], str(tmp_path / "ds"), workers=0, text_field="body")
    assert [_bytes_decode(d) for d in _docs_of(str(tmp_path / "ds"))] == DOCS + DOCS
    assert res.input_files == 2
    with pytest.raises(DatasetError, match=r"a\.jsonl:1: no field 'text'"):
        tokenize([str(jl)], str(tmp_path / "ds2"), workers=0)
    with pytest.raises(DatasetError, match=r"b\.parquet: no column 'text'"):
        tokenize([str(pqf)], str(tmp_path / "ds3"), workers=0)
    assert not (tmp_path / "ds2").exists() and not (tmp_path / "ds3").exists()


def test_same_fingerprint_whatever_the_workers(tmp_path, monkeypatch):
    docs = [f"document number {i} " * (i % 7 + 1) for i in range(60)]
    src = _write_texts(tmp_path / "in", docs)
    monkeypatch.setattr(tok_mod, "CHUNK_DOCS", 4)  # many chunks: exercises ordering
    fps = set()
    for w in (0, 1, 2):
        res = tokenize([src], str(tmp_path / f"ds{w}"), workers=w, shard_tokens=500)
        assert len(res.manifest.shards) > 3
        fps.add(res.manifest.fingerprint)
    assert len(fps) == 1
    assert [_bytes_decode(d) for d in _docs_of(str(tmp_path / "ds2"))] == docs


def test_non_utf8_file_is_replaced_and_reported(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "good.txt").write_text("fine\n")
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    warnings: list[str] = []
    res = tokenize([str(d)], str(tmp_path / "ds"), workers=0, warn=warnings.append)
    assert len(warnings) == 1 and "latin1.txt" in warnings[0] and "2 invalid" in warnings[0]
    assert res.replaced_files == 1 and res.replacements == 2
    docs = [_bytes_decode(x) for x in _docs_of(str(tmp_path / "ds"))]
    assert docs == ["fine\n", "caf\ufffd cr\ufffdme\n"]
    assert dataset_info(str(tmp_path / "ds"))["extra"]["input"]["replaced_files"] == 1


@pytest.mark.parametrize("kind", ["no-files", "empty-files", "empty-json-texts"])
def test_empty_input_is_an_error_and_writes_nothing(tmp_path, kind):
    d = tmp_path / "in"
    d.mkdir()
    if kind == "empty-files":
        (d / "a.txt").write_text("")
    elif kind == "empty-json-texts":
        (d / "a.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(DatasetError, match="the input is empty"):
        tokenize([str(d)], str(tmp_path / "ds"), workers=0)
    assert sorted(os.listdir(tmp_path)) == ["in"]  # no DEST, no temporary sibling


def test_missing_input_names_it(tmp_path):
    with pytest.raises(DatasetError, match="nope.txt does not exist"):
        tokenize([str(tmp_path / "nope.txt")], str(tmp_path / "ds"))


def test_failure_midway_leaves_no_dataset(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "ok"}) + "\n" + "{broken\n")
    with pytest.raises(DatasetError, match=r"a\.jsonl:2: not valid JSON"):
        tokenize([str(jl)], str(tmp_path / "ds"), workers=0)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_train_bpe_stores_tokenizer_and_round_trips(tmp_path):
    from tokenizers import Tokenizer

    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
    src = _write_texts(tmp_path / "in", docs)
    res = tokenize([src], str(tmp_path / "ds"), tokenizer="train:300", workers=0)
    m = res.manifest
    assert m.tokenizer["type"] == "huggingface" and m.tokenizer["file"] == "tokenizer.json"
    path = tmp_path / "ds" / "tokenizer.json"
    assert m.tokenizer["hash"].startswith("xxh3_64:")
    tok = Tokenizer.from_file(str(path))
    assert tok.token_to_id("<|endoftext|>") == m.eos_id
    decoded = [tok.decode(d[:-1]) for d in _docs_of(str(tmp_path / "ds"))]
    assert decoded == docs
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_hf_tokenizer_without_eos_gets_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(tmp_path / "tok.json"))
    src = _write_texts(tmp_path / "in")
    res = tokenize([src], str(tmp_path / "ds"), tokenizer=str(tmp_path / "tok.json"), workers=0)
    stored = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert stored.token_to_id("<|endoftext|>") == res.manifest.eos_id
    assert res.manifest.eos_id == res.manifest.vocab_size - 1
    assert all(d[-1] == res.manifest.eos_id for d in _docs_of(str(tmp_path / "ds")))


def test_directory_walk_reports_skipped_files_and_include_reads_them(tmp_path, capsys):
    """Files with no known suffix are never skipped silently: the run warns with the count
    and examples, and ``--include GLOB`` reads them."""
    from steadytrain.cli import main

    src = tmp_path / "licenses"
    src.mkdir()
    (src / "LICENSE").write_text("permission is hereby granted\n")
    (src / "COPYING").write_text("everyone is permitted to copy\n")
    (src / "notes.txt").write_text("a text file\n")
    (src / ".hidden").write_text("never read\n")
    out = tmp_path / "ds"
    assert main(["tokenize", str(src), "--out", str(out), "--workers", "0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["input_files"] == 1 and info["skipped_files"] == 2
    assert any("skipped 2 file(s)" in w and "--include" in w for w in info["warnings"])
    assert [_bytes_decode(d) for d in _docs_of(str(out))] == ["a text file\n"]

    out2 = tmp_path / "ds2"
    argv = ["tokenize", str(src), "--out", str(out2), "--workers", "0", "--json"]
    assert main(argv + ["--include", "LICENSE*", "--include", "COPY*"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["input_files"] == 3 and info["skipped_files"] == 0
    docs = sorted(_bytes_decode(d) for d in _docs_of(str(out2)))
    assert docs == sorted(
        ["permission is hereby granted\n", "everyone is permitted to copy\n", "a text file\n"]
    )


def test_directory_of_only_unknown_suffixes_names_the_fix(tmp_path):
    src = tmp_path / "bare"
    src.mkdir()
    (src / "README").write_text("text without a suffix\n")
    with pytest.raises(DatasetError, match=r"skipped 1 file.*--include"):
        tokenize([str(src)], str(tmp_path / "out"), workers=0)
    assert not (tmp_path / "out").exists()


# -- train:VOCAB on a bounded sample (issue 12 item 9) ------------------------------------
SAMPLE_BUDGET = 1 << 20  # the smallest budget allowed


def _corpus(root, files: int = 8, docs: int = 1400) -> list[str]:
    """``files`` JSON Lines files of small documents, each word-tagged with its file, plus
    one 1.2 MB text file (a single long document): ~3.6 MB of text in all, deterministic."""
    import random

    rng = random.Random(7)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(3000)
    ]
    root.mkdir()
    for f in range(files):
        with open(root / f"part{f:02d}.jsonl", "w", encoding="utf-8") as out:
            for _ in range(docs):
                body = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
                out.write(json.dumps({"text": f"tagfile{f:02d} {body}\n"}) + "\n")
    with open(root / "long.txt", "w", encoding="utf-8") as out:
        for _ in range(24_000):
            out.write("tagfilelong " + " ".join(rng.choice(words) for _ in range(6)) + "\n")
    return [f"tagfile{f:02d}" for f in range(files)] + ["tagfilelong"]


class _Recorder:
    """A progress sink that keeps what it was told (the bar's interface, no terminal)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, total, description) -> None:
        self.calls.append(("start", total, description))

    def update(self, completed, tokens=None) -> None:
        self.calls.append(("update", completed))

    def stop(self) -> None:
        self.calls.append(("stop",))


@pytest.mark.timeout(300)
def test_train_reads_at_most_the_sample_budget_from_all_files_deterministically(
    tmp_path, monkeypatch
):
    from steadytrain.data.ingest import tokenizer as tokenizer_mod

    tags = _corpus(tmp_path / "in")
    fed: list[list[str]] = []
    real_train = tokenizer_mod.train_bpe

    def counting_train(texts, vocab_size, **kw):  # the real trainer, told what it got
        texts = list(texts)
        fed.append(texts)
        return real_train(texts, vocab_size, **kw)

    monkeypatch.setattr(tokenizer_mod, "train_bpe", counting_train)
    inputs = [str(tmp_path / "in")]
    bar = _Recorder()
    res = tokenize(
        inputs,
        str(tmp_path / "a"),
        tokenizer="train:1000",
        workers=0,
        tokenizer_sample_bytes=SAMPLE_BUDGET,
        progress=bar,
    )
    total = sum(os.path.getsize(tmp_path / "in" / n) for n in os.listdir(tmp_path / "in"))
    assert total > 3 * SAMPLE_BUDGET
    trained = sum(len(t.encode("utf-8")) for t in fed[0])
    assert trained <= SAMPLE_BUDGET  # at most the budget reached the trainer ...
    assert trained > 0.9 * SAMPLE_BUDGET  # ... and most of it did
    assert max(len(t) for t in fed[0]) <= tokenizer_mod.PIECE_CHARS  # the long file in pieces
    joined = "".join(fed[0])
    assert all(tag in joined for tag in tags)  # drawn from every file, the last ones too
    info = res.manifest.extra["tokenizer_training"]
    assert info["sample_budget_bytes"] == SAMPLE_BUDGET and info["sample_bytes"] == trained
    assert info["input_text_bytes"] > 3 * SAMPLE_BUDGET
    assert bar.calls[0] == ("start", total, "sample for train:1000")
    assert ("update", total) in bar.calls  # the read is shown to the end

    # Same input and settings: the same sample and tokenizer, whatever the order of inputs.
    files = sorted(str(tmp_path / "in" / n) for n in os.listdir(tmp_path / "in"))
    again = tokenize(
        files[::-1],
        str(tmp_path / "b"),
        tokenizer="train:1000",
        workers=0,
        tokenizer_sample_bytes=SAMPLE_BUDGET,
    )
    assert fed[1] == fed[0]
    assert again.manifest.tokenizer["hash"] == res.manifest.tokenizer["hash"]
    a_json = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == a_json


@pytest.mark.timeout(300)
def test_sample_budget_is_part_of_the_recipe_and_is_checked(tmp_path, capsys):
    from steadytrain.cli import main
    from steadytrain.data.ingest.tokenizer import DEFAULT_SAMPLE_BYTES
    from steadytrain.errors import ConfigError

    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    src = _write_texts(tmp_path / "in", docs)
    kw = dict(tokenizer="train:300", workers=0)
    with pytest.raises(ConfigError, match=r"--tokenizer-sample-bytes 1000: .*at least 1048576"):
        tokenize([src], str(tmp_path / "x"), tokenizer_sample_bytes=1000, **kw)
    assert not (tmp_path / "x").exists()

    first = tokenize([src], str(tmp_path / "ds"), **kw)
    assert first.manifest.extra["tokenizer_training"]["sample_budget_bytes"] == (
        DEFAULT_SAMPLE_BYTES
    )
    assert tokenize([src], str(tmp_path / "ds"), **kw).up_to_date
    other = tokenize([src], str(tmp_path / "ds2"), tokenizer_sample_bytes=2 << 20, **kw)
    assert other.manifest.extra["recipe"] != first.manifest.extra["recipe"]
    # The input is within both budgets: both trained on all of it, the same tokenizer.
    assert other.manifest.tokenizer["hash"] == first.manifest.tokenizer["hash"]

    argv = ["tokenize", src, "--out", str(tmp_path / "ds3"), "--workers", "0"]
    assert main(argv + ["--tokenizer-sample-bytes", "2097152"]) == 2  # bytes trains nothing
    assert "applies to --tokenizer train:VOCAB only" in capsys.readouterr().err
    assert main(argv + ["--tokenizer", "train:300", "--tokenizer-sample-bytes", "2097152"]) == 0
    manifest = json.loads((tmp_path / "ds3" / "manifest.json").read_text())
    assert manifest["extra"]["tokenizer_training"]["sample_budget_bytes"] == 2097152
    assert manifest["extra"]["recipe"] == other.manifest.extra["recipe"]  # CLI = library
    with pytest.raises(SystemExit):
        main(["tokenize", "--help"])
    assert f"default {DEFAULT_SAMPLE_BYTES}" in " ".join(capsys.readouterr().out.split())
