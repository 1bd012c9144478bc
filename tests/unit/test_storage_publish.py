"""storage.publish: the one way a local file or directory becomes visible, and the one hash."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from steadytrain.storage import publish
from steadytrain.storage.publish import (
    Hasher,
    atomic_writer,
    checksum_bytes,
    digest_bytes,
    file_checksum,
    file_digest,
    fsync_dir,
    publish_bytes,
    publish_dir,
    publish_file,
    publish_new_dir,
    temp_name,
)


def _entries(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("durable", [True, False])
def test_an_error_inside_atomic_writer_keeps_the_old_file_and_leaves_no_temp(tmp_path, durable):
    final = tmp_path / "state.json"
    final.write_text("old")
    with (
        pytest.raises(RuntimeError, match="boom"),
        atomic_writer(str(final), "w", durable=durable) as f,
    ):
        f.write("new, but only half")
        raise RuntimeError("boom")
    assert final.read_text() == "old"
    assert _entries(tmp_path) == ["state.json"]


def test_atomic_writer_replaces_whole_and_creates_the_parent(tmp_path):
    final = tmp_path / "sub" / "dir" / "blob.bin"
    with atomic_writer(str(final)) as f:
        f.write(b"abc")
        # Until the block ends the final name does not exist; only a hidden temporary does.
        assert not final.exists()
        (tmp_name,) = _entries(final.parent)
        assert tmp_name.startswith(".blob.bin.tmp-")
    assert final.read_bytes() == b"abc"
    publish_bytes(str(final), b"second")
    assert final.read_bytes() == b"second"
    assert _entries(final.parent) == ["blob.bin"]


def test_atomic_writer_hashes_what_it_writes(tmp_path):
    h = Hasher()
    data = os.urandom(3 << 20)
    with atomic_writer(str(tmp_path / "x"), hasher=h) as f:
        f.write(data[:1000])
        f.write(memoryview(data)[1000:])
    assert h.size == len(data)
    assert h.digest_hex() == xxhash.xxh3_64_hexdigest(data)
    assert h.hexdigest() == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"
    assert file_digest(str(tmp_path / "x")) == (len(data), h.digest_hex())


def test_atomic_writer_refuses_modes_that_cannot_be_published(tmp_path):
    with pytest.raises(ValueError, match="'a'"), atomic_writer(str(tmp_path / "x"), "a"):
        pass
    with pytest.raises(ValueError, match="binary"):
        with atomic_writer(str(tmp_path / "x"), "w", hasher=Hasher()):
            pass
    assert _entries(tmp_path) == []


def test_text_is_written_as_utf8(tmp_path):
    publish_bytes(str(tmp_path / "t.txt"), "größe ✓")
    assert (tmp_path / "t.txt").read_bytes() == "größe ✓".encode()


def test_hashes_match_xxhash_of_the_bytes(tmp_path):
    data = os.urandom((9 << 20) + 17)  # more than one 8 MiB read chunk, not a multiple
    path = tmp_path / "f"
    path.write_bytes(data)
    want = xxhash.xxh3_64_hexdigest(data)
    assert digest_bytes(data) == want
    assert checksum_bytes(data) == f"xxh3_64:{want}"
    assert file_digest(str(path)) == (len(data), want)
    assert file_digest(str(path), chunk=4096) == (len(data), want)
    assert file_checksum(str(path)) == f"xxh3_64:{want}"
    tokens = np.arange(1000, dtype=np.uint16)  # arrays hash as their raw bytes
    h = Hasher()
    h.update(tokens[:400])
    h.update(tokens[400:])
    assert h.size == tokens.nbytes
    assert h.hexdigest() == checksum_bytes(tokens) == checksum_bytes(tokens.tobytes())


def test_publish_file_renames_and_removes_the_temp_on_error(tmp_path):
    final = str(tmp_path / "out.bin")
    tmp = temp_name(final)
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".")
    with open(tmp, "wb") as f:
        f.write(b"done")
    publish_file(tmp, final)
    assert _entries(tmp_path) == ["out.bin"]
    # Publishing onto a directory fails; the temporary is cleaned up, the target untouched.
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep").write_text("k")
    tmp2 = temp_name(str(tmp_path / "adir"))
    with open(tmp2, "wb") as f:
        f.write(b"x")
    with pytest.raises(OSError):
        publish_file(tmp2, str(tmp_path / "adir"))
    assert not os.path.exists(tmp2)
    assert (tmp_path / "adir" / "keep").read_text() == "k"


def test_temp_names_are_unique(tmp_path):
    final = str(tmp_path / "x")
    assert len({temp_name(final) for _ in range(100)}) == 100


def _build(tmp_path, final: str, content: str) -> str:
    tmp = temp_name(final)
    os.makedirs(os.path.join(tmp, "shards"))
    publish_bytes(os.path.join(tmp, "shards", "a"), content)
    return tmp


def test_publish_dir_puts_a_finished_directory_in_place(tmp_path):
    final = str(tmp_path / "ds")
    tmp = _build(tmp_path, final, "one")
    publish_dir(tmp, final)
    assert (tmp_path / "ds" / "shards" / "a").read_text() == "one"
    assert _entries(tmp_path) == ["ds"]
    # A missing-or-empty destination is what "never overwritten" allows.
    empty = tmp_path / "empty"
    empty.mkdir()
    publish_dir(_build(tmp_path, str(empty), "two"), str(empty))
    assert (empty / "shards" / "a").read_text() == "two"


def test_publish_dir_refuses_to_overwrite_an_existing_directory(tmp_path):
    final = str(tmp_path / "ds")
    publish_dir(_build(tmp_path, final, "old"), final)
    tmp = _build(tmp_path, final, "new")
    with pytest.raises(FileExistsError) as err:
        publish_dir(tmp, final)
    assert err.value.filename == final
    # The old directory is untouched and the finished new one is kept for the caller.
    assert (tmp_path / "ds" / "shards" / "a").read_text() == "old"
    assert open(os.path.join(tmp, "shards", "a")).read() == "new"


@pytest.mark.parametrize("renameat2", [True, False])
def test_publish_new_dir_never_replaces_even_an_empty_directory(tmp_path, monkeypatch, renameat2):
    """An export's destination made by someone else while the export was built: empty, so
    a plain rename would replace it. Without renameat2 (another system), the check just
    before the rename refuses it the same way."""
    if not renameat2:
        monkeypatch.setattr(publish, "_renameat2", lambda: None)
    final = tmp_path / "dest"
    final.mkdir()
    tmp = _build(tmp_path, str(final), "mine")
    with pytest.raises(FileExistsError) as err:
        publish_new_dir(tmp, str(final))
    assert err.value.filename == str(final)
    assert _entries(final) == [] and open(os.path.join(tmp, "shards", "a")).read() == "mine"
    final.rmdir()
    publish_new_dir(tmp, str(final))
    assert (final / "shards" / "a").read_text() == "mine" and not os.path.exists(tmp)


def test_fsync_dir_accepts_the_current_directory_and_names_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fsync_dir("")
    with pytest.raises(FileNotFoundError) as err:
        fsync_dir(str(tmp_path / "nope"))
    assert err.value.filename == str(tmp_path / "nope")


def test_a_dataset_build_that_loses_the_race_for_dest_is_kept_and_named(tmp_path):
    from steadytrain.data.ingest.output import Output
    from steadytrain.errors import DatasetError

    dest = tmp_path / "ds"
    out = Output(str(dest))
    out.begin().write_bytes_atomic("shards/a", b"built")
    built = out.tmp_path
    dest.mkdir()  # another writer got there between the check and the publish
    (dest / "theirs").write_text("t")
    with pytest.raises(DatasetError) as err:
        out.commit()
    assert str(dest) in str(err.value) and built in str(err.value)
    assert (dest / "theirs").read_text() == "t" and _entries(dest) == ["theirs"]
    assert open(os.path.join(built, "shards", "a"), "rb").read() == b"built"
    out.discard()  # nothing left to discard: the kept build is the user's now
    assert os.path.isdir(built)
