"""tokenize: what happens when DEST already holds something; the CLI contract."""

from __future__ import annotations

import json
import os

import pytest

from steadytrain.cli import main
from steadytrain.data.ingest.tokenize import tokenize
from steadytrain.data.ingest.verify import dataset_info
from steadytrain.errors import DatasetError


def _corpus(d, texts) -> str:
    d.mkdir(exist_ok=True)
    for i, t in enumerate(texts):
        (d / f"{i}.txt").write_text(t)
    return str(d)


def test_rerun_is_up_to_date_and_keeps_files(tmp_path):
    src = _corpus(tmp_path / "in", ["a b c", "d e f"])
    dest = str(tmp_path / "ds")
    first = tokenize([src], dest, workers=0)
    mtime = os.stat(os.path.join(dest, "manifest.json")).st_mtime_ns
    again = tokenize([src], dest, workers=0)
    assert again.up_to_date and again.manifest.fingerprint == first.manifest.fingerprint
    assert os.stat(os.path.join(dest, "manifest.json")).st_mtime_ns == mtime


def test_same_content_from_touched_inputs_is_up_to_date(tmp_path):
    src = _corpus(tmp_path / "in", ["a b c", "d e f"])
    dest = str(tmp_path / "ds")
    first = tokenize([src], dest, workers=0)
    os.utime(tmp_path / "in" / "0.txt", (1, 1))  # recipe differs, content does not
    again = tokenize([src], dest, workers=0)
    assert again.up_to_date and again.manifest.fingerprint == first.manifest.fingerprint
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_different_dataset_in_dest_is_refused_and_untouched(tmp_path):
    dest = str(tmp_path / "ds")
    first = tokenize([_corpus(tmp_path / "a", ["one"])], dest, workers=0)
    with pytest.raises(DatasetError) as err:
        tokenize([_corpus(tmp_path / "b", ["two"])], dest, workers=0)
    msg = str(err.value)
    assert dest in msg and "different dataset" in msg and "delete" in msg
    assert dataset_info(dest)["fingerprint"] == first.manifest.fingerprint
    # A different vocabulary is refused before any work.
    with pytest.raises(DatasetError, match="vocab_size/eos_id"):
        tokenize([str(tmp_path / "b")], dest, workers=0, tokenizer="train:260")
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_dest_with_foreign_files_is_refused(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not a steadytrain dataset"):
        tokenize([_corpus(tmp_path / "in", ["x"])], str(dest), workers=0)
    assert os.listdir(dest) == ["notes.txt"]


def test_debris_of_unfinished_run_is_replaced(tmp_path):
    dest = tmp_path / "ds"
    (dest / "shards").mkdir(parents=True)
    (dest / "shards" / "shard-00000.tokens").write_bytes(b"\x00" * 10)  # no manifest
    res = tokenize([_corpus(tmp_path / "in", ["x"])], str(dest), workers=0)
    assert dataset_info(str(dest))["fingerprint"] == res.manifest.fingerprint


def test_empty_dest_dir_is_used(tmp_path):
    (tmp_path / "ds").mkdir()
    tokenize([_corpus(tmp_path / "in", ["x"])], str(tmp_path / "ds"), workers=0)
    assert dataset_info(str(tmp_path / "ds"))["num_docs"] == 1


def test_cli_json_tokenize_inspect_verify(tmp_path, capsys):
    src = _corpus(tmp_path / "in", ["alpha", "beta", "gamma"])
    dest = str(tmp_path / "ds")
    assert main(["tokenize", src, "--out", dest, "--workers", "0", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_docs"] == 3 and out["num_tokens"] == 5 + 4 + 5 + 3 and not out["up_to_date"]
    assert main(["inspect", dest, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("num_tokens", "num_docs", "num_shards", "dtype", "vocab_size", "fingerprint"):
        assert info[key] == out[key]
    assert info["eos_id"] == 256 and info["tokenizer"]["type"] == "bytes" and info["bytes"] > 0
    assert main(["verify", dest, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["problems"] == [] and rep["fingerprint"] == out["fingerprint"]
    assert main(["tokenize", src, "--out", dest, "--workers", "0"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_cli_errors_exit_nonzero_with_message(tmp_path, capsys):
    rc = main(["tokenize", str(tmp_path / "missing"), "--out", str(tmp_path / "ds")])
    assert rc == 2 and "missing does not exist" in capsys.readouterr().err
    rc = main(["inspect", str(tmp_path / "nothing")])
    assert rc == 2 and "manifest.json does not exist" in capsys.readouterr().err


def test_demo_data_stage(tmp_path, capsys):
    from steadytrain.demo import run_demo

    out = run_demo(str(tmp_path / "run"), workers=0, corpus_limit_bytes=200_000, train=False)
    assert out["steps"] == 0 and out["restarts"] == 0 and out["goodput"] is None
    assert out["report"] is None and out["run_dir"] == str(tmp_path / "run")
    assert out["dataset"]["verified"] is True
    assert out["dataset"]["num_tokens"] > 200_000 and out["dataset"]["num_docs"] > 1
    assert main(["verify", str(tmp_path / "run" / "data"), "--quiet"]) == 0


def test_remote_dest_url_path(tmp_path):
    """An fsspec URL (in-memory filesystem): no temp dir, shards then manifest, verify reads it."""
    import uuid

    import fsspec

    from steadytrain.data.ingest.verify import verify_dataset

    src = _corpus(tmp_path / "in", ["alpha " * 50, "beta " * 50, "gamma"])
    url = f"memory://st-{uuid.uuid4().hex[:8]}/ds"
    res = tokenize([src], url, workers=0, shard_tokens=100)
    assert len(res.manifest.shards) == 3
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no local temp dir
    assert verify_dataset(url).ok and dataset_info(url)["num_docs"] == 3
    assert tokenize([src], url, workers=0, shard_tokens=100).up_to_date
    with pytest.raises(DatasetError, match="already holds a different dataset"):
        tokenize([src], url, workers=0, shard_tokens=50)
    fs = fsspec.filesystem("memory")
    path = url.split("://", 1)[1] + "/shards/shard-00001.tokens"
    data = bytearray(fs.cat_file(path))
    data[0] ^= 1
    fs.pipe_file(path, bytes(data))
    report = verify_dataset(url)
    assert [p.file for p in report.problems] == [f"{url}/shards/shard-00001.tokens"]


def test_stdlib_corpus_is_sorted_and_excludes_third_party():
    from steadytrain.data.ingest.corpus import stdlib_corpus_paths, stdlib_dir

    paths = stdlib_corpus_paths(limit_bytes=300_000)
    root = stdlib_dir()
    rel = [os.path.relpath(p, root) for p in paths]
    assert rel == sorted(rel) and all(p.endswith(".py") for p in paths)
    assert not any("site-packages" in p for p in stdlib_corpus_paths())


def test_inspect_text_output(tmp_path, capsys):
    dest = str(tmp_path / "ds")
    tokenize([_corpus(tmp_path / "in", ["abc"])], dest, workers=0)
    assert main(["inspect", dest]) == 0
    out = capsys.readouterr().out
    assert "tokens       4" in out and "fingerprint" in out and "bytes" in out


@pytest.mark.timeout(180)  # a hang guard only: nothing here reads a clock
def test_sigkill_midway_leaves_nothing_inspect_accepts(tmp_path):
    """A real crash (SIGKILL) after shards were published: DEST is still not a dataset."""
    import glob
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(8000):
            f.write(json.dumps({"text": f"document {i} " + "x" * 1000}) + "\n")
    dest = str(tmp_path / "ds")
    code = (
        "import sys; from steadytrain.data.ingest.tokenize import tokenize; "
        "tokenize([sys.argv[1]], sys.argv[2], workers=0, shard_tokens=2000)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(src), dest])
    try:
        # Poll for the 4th shard; no clock: the child's start-up takes what the machine
        # needs, and the test's timeout guards a child that never gets there.
        while not glob.glob(str(tmp_path / ".ds.tmp-*" / "shards" / "shard-00003.tokens")):
            assert proc.poll() is None, "tokenize finished before it could be killed"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not os.path.exists(dest)
    with pytest.raises(DatasetError, match="manifest.json does not exist"):
        dataset_info(dest)
    # The next run is not confused by the leftover hidden sibling.
    res = tokenize([_corpus(tmp_path / "small", ["ok"])], dest, workers=0)
    assert dataset_info(dest)["fingerprint"] == res.manifest.fingerprint


def test_cli_demo_json_data_stage(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert main(["demo", "--json", "--run-dir", run_dir, "--workers", "0", "--no-train"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_dir"] == run_dir and out["steps"] == 0 and out["restarts"] == 0
    assert out["goodput"] is None and out["report"] is None
    ds = out["dataset"]
    assert ds["num_tokens"] > 1_000_000 and ds["vocab_size"] == 257 and ds["num_docs"] > 100
    assert main(["verify", os.path.join(run_dir, "data"), "--quiet"]) == 0
