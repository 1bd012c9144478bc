"""verify / inspect on damaged datasets: each problem is found and names the bad file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xxhash

from steadytrain.cli import main
from steadytrain.data.ingest.tokenize import tokenize
from steadytrain.data.ingest.verify import dataset_info, verify_dataset
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.format import ShardInfo, compute_fingerprint
from steadytrain.errors import DatasetError

SHARD0 = "shards/shard-00000.tokens"
INDEX0 = "shards/shard-00000.idx"


@pytest.fixture
def ds(tmp_path) -> str:
    src = tmp_path / "in"
    src.mkdir()
    for i in range(12):
        (src / f"{i:02d}.txt").write_text(f"document {i} " * 20)
    dest = str(tmp_path / "ds")
    res = tokenize([str(src)], dest, workers=0, shard_tokens=1000)
    assert len(res.manifest.shards) >= 2
    assert verify_dataset(dest).ok
    return dest


def _rewrite(ds: str, mutate) -> None:
    """Edit the manifest JSON, then make its fingerprint consistent again."""
    path = os.path.join(ds, "manifest.json")
    obj = json.load(open(path))
    mutate(obj)
    shards = [ShardInfo.from_json(s, where="test") for s in obj["shards"]]
    obj["fingerprint"] = compute_fingerprint(obj["dtype"], obj["vocab_size"], obj["eos_id"], shards)
    json.dump(obj, open(path, "w"))


def _problems(ds: str) -> list[str]:
    report = verify_dataset(ds)
    assert not report.ok
    return [str(p) for p in report.problems]


def test_truncated_shard(ds):
    path = os.path.join(ds, SHARD0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    probs = _problems(ds)
    assert len(probs) == 1 and SHARD0 in probs[0] and "truncated" in probs[0]
    with pytest.raises(DatasetError, match=SHARD0):
        dataset_info(ds)  # inspect refuses it too
    with pytest.raises(DatasetError, match="truncated"):
        TokenDataset.open(ds)


def test_flipped_byte(ds):
    path = os.path.join(ds, SHARD0)
    with open(path, "r+b") as f:
        f.seek(6)
        b = f.read(1)
        f.seek(6)
        f.write(bytes([b[0] ^ 0x01]))
    probs = _problems(ds)
    assert len(probs) == 1 and SHARD0 in probs[0] and "checksum" in probs[0]


def test_flipped_byte_in_index(ds):
    path = os.path.join(ds, INDEX0)
    with open(path, "r+b") as f:
        f.seek(6)  # first document end becomes huge: the next one is smaller
        f.write(b"\x01")
    probs = _problems(ds)
    assert any(INDEX0 in p and "checksum" in p for p in probs)
    assert any(INDEX0 in p and "strictly increasing" in p for p in probs)


def test_missing_shard(ds, capsys):
    os.unlink(os.path.join(ds, SHARD0))
    probs = _problems(ds)
    assert len(probs) == 1 and SHARD0 in probs[0] and "missing" in probs[0]
    assert main(["verify", ds, "--quiet"]) == 1
    assert SHARD0 in capsys.readouterr().err
    assert main(["inspect", ds]) == 2


def test_token_ids_beyond_vocab(ds):
    path = os.path.join(ds, SHARD0)
    toks = np.fromfile(path, dtype="<u2")
    toks[3] = 300  # vocab is 257; keep the checksum consistent so only the range check fires
    toks.tofile(path)

    def fix(obj):
        obj["shards"][0]["checksum"] = f"xxh3_64:{xxhash.xxh3_64_hexdigest(toks)}"

    _rewrite(ds, fix)
    probs = _problems(ds)
    assert (
        len(probs) == 1
        and SHARD0 in probs[0]
        and "token id 300" in probs[0]
        and "at token 3" in probs[0]
    )


def test_index_not_ending_at_token_count(ds):
    path = os.path.join(ds, INDEX0)
    ends = np.fromfile(path, dtype="<u8")
    ends[-1] -= 1
    ends.tofile(path)
    digest = f"xxh3_64:{xxhash.xxh3_64_hexdigest(ends)}"
    _rewrite(ds, lambda o: o["shards"][0]["index"].update(checksum=digest))
    probs = _problems(ds)
    assert len(probs) == 1 and INDEX0 in probs[0] and "last document ends" in probs[0]


def test_unknown_manifest_version(ds, capsys):
    _rewrite(ds, lambda o: o.update(version=2))
    probs = _problems(ds)
    assert "manifest.json" in probs[0] and "version 2 is not supported" in probs[0]
    assert main(["verify", ds, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["problems"][0]["file"].endswith("manifest.json")


@pytest.mark.parametrize("bad", ["../outside.tokens", "/etc/passwd", "shards/../../x.tokens"])
def test_shard_name_escaping_the_dataset(ds, bad):
    path = os.path.join(ds, "manifest.json")
    obj = json.load(open(path))
    obj["shards"][0]["name"] = bad  # names are not part of the fingerprint
    json.dump(obj, open(path, "w"))
    probs = _problems(ds)
    assert "manifest.json" in probs[0] and repr(bad) in probs[0]
    with pytest.raises(DatasetError):
        dataset_info(ds)


def test_damaged_manifest_fingerprint(ds):
    path = os.path.join(ds, "manifest.json")
    obj = json.load(open(path))
    obj["shards"][0]["tokens"] += 1  # edited without recomputing the fingerprint
    json.dump(obj, open(path, "w"))
    assert "fingerprint" in _problems(ds)[0]


def test_totals_disagree_with_shards(ds):
    _rewrite(ds, lambda o: o.update(num_tokens=o["num_tokens"] + 5))
    probs = _problems(ds)
    assert "num_tokens" in probs[0]


def test_tokenizer_hash_mismatch(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("some text to train on " * 10)
    dest = str(tmp_path / "ds")
    tokenize([str(src)], dest, workers=0, tokenizer="train:270")
    with open(os.path.join(dest, "tokenizer.json"), "a") as f:
        f.write(" ")
    probs = _problems(dest)
    assert len(probs) == 1 and "tokenizer.json" in probs[0]


def test_unknown_extra_files_are_fine(ds):
    open(os.path.join(ds, "README.txt"), "w").write("notes")
    open(os.path.join(ds, "shards", "other.bin"), "w").write("x")
    assert verify_dataset(ds).ok
