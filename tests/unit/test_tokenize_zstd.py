""".jsonl.zst / .ndjson.zst input: decompressed through zstandard, all frames read, a
truncated or damaged stream names the file, and a missing zstandard names the extra."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from steadytrain.data.ingest.tokenize import tokenize
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.errors import DatasetError

zstandard = pytest.importorskip("zstandard")

pytestmark = pytest.mark.timeout(120)

# Enough text that the compressed file spans several zstd blocks and reader chunks.
DOCS = [f"document {i}: " + "ünïcødé ✓ " * (i % 7) + "x" * (i % 300) for i in range(3000)]


def _jsonl_bytes(docs: list[str] = DOCS) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()


def _token_ids(url: str) -> list[int]:
    ds = TokenDataset.open(url)
    return np.concatenate([np.asarray(ds.tokens(s)) for s in range(ds.num_shards)]).tolist()


def test_jsonl_zst_gives_the_same_tokens_as_plain_jsonl(tmp_path):
    raw = _jsonl_bytes()
    (tmp_path / "plain.jsonl").write_bytes(raw)
    (tmp_path / "packed.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
    plain = tokenize([str(tmp_path / "plain.jsonl")], str(tmp_path / "ds_plain"), workers=0)
    packed = tokenize([str(tmp_path / "packed.jsonl.zst")], str(tmp_path / "ds_zst"), workers=0)
    assert packed.manifest.num_docs == plain.manifest.num_docs == len(DOCS)
    assert _token_ids(str(tmp_path / "ds_zst")) == _token_ids(str(tmp_path / "ds_plain"))


def test_multi_frame_ndjson_zst_in_a_directory_reads_every_frame(tmp_path):
    # `zstd -T0`, pzstd and concatenated files produce several frames: all of them count.
    half = len(DOCS) // 2
    cctx = zstandard.ZstdCompressor()
    d = tmp_path / "in"
    d.mkdir()
    (d / "part.ndjson.zst").write_bytes(
        cctx.compress(_jsonl_bytes(DOCS[:half])) + cctx.compress(_jsonl_bytes(DOCS[half:]))
    )
    (tmp_path / "plain.jsonl").write_bytes(_jsonl_bytes())
    res = tokenize([str(d)], str(tmp_path / "ds"), workers=0)
    tokenize([str(tmp_path / "plain.jsonl")], str(tmp_path / "ds_plain"), workers=0)
    assert res.manifest.num_docs == len(DOCS)
    assert _token_ids(str(tmp_path / "ds")) == _token_ids(str(tmp_path / "ds_plain"))


@pytest.mark.parametrize("cut", ["half", "tail"])
def test_truncated_zst_names_the_file(tmp_path, cut):
    data = zstandard.ZstdCompressor().compress(_jsonl_bytes())
    data = {"half": data[: len(data) // 2], "tail": data[:-3]}[cut]
    bad = tmp_path / "cut.jsonl.zst"
    bad.write_bytes(data)
    with pytest.raises(DatasetError, match=r"cut\.jsonl\.zst: truncated zstd stream"):
        tokenize([str(bad)], str(tmp_path / "ds"), workers=0)
    assert not (tmp_path / "ds").exists(), "a failed input must not publish a dataset"


def test_not_zstd_data_names_the_file(tmp_path):
    bad = tmp_path / "plain-really.jsonl.zst"
    bad.write_bytes(_jsonl_bytes(DOCS[:5]))
    with pytest.raises(DatasetError, match=r"plain-really\.jsonl\.zst: not a valid zstd stream"):
        tokenize([str(bad)], str(tmp_path / "ds"), workers=0)


def test_missing_zstandard_names_the_extra(tmp_path):
    src = tmp_path / "in.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(DOCS[:5])))
    # A real CLI process in which `import zstandard` fails, as on a core-only install
    # (None in sys.modules makes the import raise ModuleNotFoundError).
    code = (
        "import sys; sys.modules['zstandard'] = None; "
        "from steadytrain.cli import main; "
        f"sys.exit(main(['tokenize', {str(src)!r}, '--out', {str(tmp_path / 'ds')!r}, "
        "'--workers', '0']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'steadytrain[zstd]'" in proc.stderr
    assert "in.jsonl.zst" in proc.stderr
    assert "JSON" not in proc.stderr, "the bytes must not be parsed as JSON"
    assert not (tmp_path / "ds").exists()
