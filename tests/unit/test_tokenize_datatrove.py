"""datatrove import, on output the real ``datatrove`` package writes in the test.

datatrove's ``DocumentTokenizer`` (and ``DocumentTokenizerMerger``) run here on a handful of
documents with a local ``tokenizer.json`` made by HF ``tokenizers``: no hub access
(HF_HUB_OFFLINE=1). The imported dataset must hold exactly the ids the tokenizer gives for
each document, document by document.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from steadytrain.cli import main
from steadytrain.data.ingest.datatrove import import_datatrove
from steadytrain.data.ingest.verify import verify_dataset
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.errors import ConfigError, DatasetError

EOS = "<|endoftext|>"
TEXTS = [
    f"document {i}: the quick brown fox jumps over {i * 7} lazy dogs" + " again" * (i % 4)
    for i in range(12)
]


def _docs(url: str) -> list[list[int]]:
    """Every document of every shard, in stream order."""
    ds = TokenDataset.open(url)
    docs = []
    for s in range(ds.num_shards):
        toks, ends = np.asarray(ds.tokens(s)), np.asarray(ds.doc_ends(s))
        docs += [toks[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return docs


def _tokenize(out: str, tokenizer: str, texts: list[str], ranks: int, **kw) -> None:
    """What a datatrove job with ``ranks`` tasks writes: one ``.ds`` per rank."""
    # datatrove imported here, not at collection: every xdist worker collects this module
    # and only the one that runs it (a module fixture keeps it whole) needs the package.
    from datatrove.data import Document
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    for rank in range(ranks):
        step = DocumentTokenizer(out, tokenizer_name_or_path=tokenizer, save_filename="run", **kw)
        docs = (Document(text=t, id=str(i)) for i, t in enumerate(texts[rank::ranks]))
        step.run(docs, rank=rank, world_size=ranks)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[str, Tokenizer]:
    """A small byte-level BPE with <|endoftext|>, trained here and saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer)
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path, tok


def _expected(tok: Tokenizer, texts: list[str], eos: bool = True) -> list[list[int]]:
    tail = [tok.token_to_id(EOS)] if eos else []
    return [tok.encode(t).ids + tail for t in texts]


def test_document_tokenizer_output_imports_id_for_id(tmp_path, bpe):
    path, tok = bpe
    src = str(tmp_path / "dt")
    _tokenize(src, path, TEXTS, ranks=2, eos_token=EOS, shuffle_documents=False)
    res = import_datatrove(src, str(tmp_path / "ds"))
    m = res.manifest
    # Rank 0's file, then rank 1's (path order); each in datatrove's (unshuffled) order.
    assert _docs(str(tmp_path / "ds")) == _expected(tok, TEXTS[0::2] + TEXTS[1::2])
    assert m.dtype == "uint16" and len(m.shards) == 2 and m.eos_id == tok.token_to_id(EOS)
    assert m.tokenizer == {"type": "datatrove", "name": path, "vocab_size": m.vocab_size, "eos_id": m.eos_id}  # fmt: skip
    dt = m.extra["datatrove"]
    assert dt["docs_end_with_eos"] and dt["token_size"] == 2 and dt["tokenizer"] == path
    assert dt["files"] == ["run_00000_unshuffled.ds", "run_00001_unshuffled.ds"]
    # The .ds bytes are the shard: linked, not rewritten.
    shard = tmp_path / "ds" / m.shards[0].name
    assert res.linked and os.stat(shard).st_ino == os.stat(f"{src}/run_00000_unshuffled.ds").st_ino
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_merged_shuffled_output_with_tokenizer_json_through_the_cli(tmp_path, bpe, capsys):
    path, tok = bpe
    _tokenize(str(tmp_path / "dt"), path, TEXTS, ranks=3, eos_token=EOS, seed=3)
    merged = str(tmp_path / "merged")
    from datatrove.pipeline.tokens.merger import DocumentTokenizerMerger

    merger = DocumentTokenizerMerger(
        str(tmp_path / "dt"), merged, save_filename="m", seed=5, progress=False
    )
    merger.run()
    dest = str(tmp_path / "ds")
    argv = ["tokenize", "--from-datatrove", merged, "--tokenizer", path, "--out", dest, "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_docs"] == len(TEXTS) and out["extra"]["datatrove"]["files"] == ["000_m.ds"]
    docs = _docs(dest)
    assert docs != _expected(tok, TEXTS)  # datatrove shuffled them (seeded)...
    assert sorted(docs) == sorted(_expected(tok, TEXTS))  # ...and every one is exact
    m = TokenDataset.open(dest).manifest
    assert m.tokenizer["type"] == "huggingface" and os.path.isfile(f"{dest}/tokenizer.json")
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["up_to_date"]


def test_uint32_ids_empty_documents_and_no_eos(tmp_path):
    """A vocabulary over 65536 makes datatrove write 4-byte ids; without eos_token an empty
    text is an empty document (a repeated end), which v1 drops."""
    words = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    texts = ["w69999 w1 w65536", "", "w7 w70", "w123 w45678 w69998 w2"]
    _tokenize(str(tmp_path / "dt"), path, texts, ranks=1, shuffle_documents=False)
    with pytest.raises(ConfigError, match="--eos-id"):
        import_datatrove(str(tmp_path / "dt"), str(tmp_path / "ds"))
    m = import_datatrove(str(tmp_path / "dt"), str(tmp_path / "ds"), eos_id=0).manifest
    assert m.dtype == "uint32" and m.vocab_size == 70_000
    assert _docs(str(tmp_path / "ds")) == [tok.encode(t).ids for t in texts if t]
    dt = m.extra["datatrove"]
    assert dt["empty_docs_dropped"] == 1 and dt["documents"] == 4
    assert dt["docs_end_with_eos"] is False
    assert verify_dataset(str(tmp_path / "ds")).ok


def test_missing_index_truncated_ds_and_missing_metadata_name_the_file(tmp_path, bpe):
    path, _ = bpe
    src = tmp_path / "dt"
    _tokenize(str(src), path, TEXTS, ranks=1, eos_token=EOS, shuffle_documents=False)
    ds = src / "run_00000_unshuffled.ds"
    dest = str(tmp_path / "ds")

    shutil.move(f"{ds}.index", tmp_path / "index")
    with pytest.raises(DatasetError, match=r"run_00000_unshuffled\.ds\.index does not exist"):
        import_datatrove(str(src), dest)
    shutil.move(tmp_path / "index", f"{ds}.index")

    full = ds.read_bytes()
    ds.write_bytes(full[:-6])
    with pytest.raises(DatasetError, match=rf"unshuffled\.ds: {len(full) - 6} bytes.*truncated"):
        import_datatrove(str(src), dest)
    ds.write_bytes(full[:-1])  # half a token
    with pytest.raises(DatasetError, match=r"unshuffled\.ds: .* truncated"):
        import_datatrove(str(src), dest)
    ds.write_bytes(full)

    shutil.move(f"{ds}.metadata", tmp_path / "metadata")
    with pytest.raises(DatasetError, match=r"unshuffled\.ds\.metadata does not exist.*--token-size"):  # fmt: skip
        import_datatrove(str(src), dest)
    assert not os.path.exists(dest)  # nothing half-made
    assert import_datatrove(str(src), dest, token_size=2).manifest.num_docs == len(TEXTS)
