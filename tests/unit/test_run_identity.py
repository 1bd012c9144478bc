"""The run's identity (``steadytrain.run_identity``): made once, read back by every later
attempt, adopted from the checkpoints when the run directory was lost, and never taken from
a file this user did not write or cannot trust."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from steadytrain import run_identity as ri


def test_made_once_then_read_back(tmp_path):
    first = ri.establish(tmp_path)
    assert first.origin == "new" and ri.is_nonce(first.nonce)
    again = ri.establish(tmp_path)
    assert again == ri.RunIdentity(first.nonce, "existing")
    doc = json.loads((tmp_path / ri.IDENTITY_FILE).read_text())
    assert doc["nonce"] == first.nonce and doc["format"] == ri.FORMAT


def test_two_runs_in_fresh_dirs_differ(tmp_path):
    assert ri.establish(tmp_path / "a").nonce != ri.establish(tmp_path / "b").nonce


def test_adopts_the_checkpoints_nonce_only_when_the_run_dir_has_none(tmp_path):
    theirs = ri.new_nonce()
    asked = []

    def adopt():
        asked.append(1)
        return theirs

    got = ri.establish(tmp_path, adopt)
    assert got == ri.RunIdentity(theirs, "adopted")
    assert ri.establish(tmp_path, adopt) == ri.RunIdentity(theirs, "existing")
    assert len(asked) == 1  # a run dir with an identity never asks the checkpoints


@pytest.mark.parametrize("bad", [None, "", "xyz", "A" * 32, 7])
def test_a_malformed_adopted_nonce_is_not_taken(tmp_path, bad):
    got = ri.establish(tmp_path, lambda: bad)
    assert got.origin == "new" and got.nonce != bad


def test_an_adopt_that_raises_publishes_nothing_so_the_next_attempt_asks_again(tmp_path):
    """A failed listing of the checkpoints must not disown them for good: the identity of
    this attempt stays in memory, and the next attempt adopts once the listing works."""

    def adopt():
        raise OSError("listing failed")

    assert ri.establish(tmp_path, adopt).origin == "new"
    assert not (tmp_path / ri.IDENTITY_FILE).exists()
    theirs = ri.new_nonce()
    assert ri.establish(tmp_path, lambda: theirs) == ri.RunIdentity(theirs, "adopted")


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "not JSON"),
        (b'{"format": "other", "nonce": "00"}', "not a steadytrain-run-identity"),
        (b'{"format": "steadytrain-run-identity", "version": 9}', "version 9"),
        (b'{"format": "steadytrain-run-identity", "version": 1, "nonce": "zz"}', "nonce"),
        (b"[" * 100_000, "larger than"),
    ],
)
def test_an_unusable_file_is_replaced_with_a_warning(tmp_path, caplog, content, why):
    (tmp_path / ri.IDENTITY_FILE).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="steadytrain"):
        got = ri.establish(tmp_path, lambda: ri.new_nonce())
    assert got.origin == "new"  # never adopted over a file that was there
    assert why in caplog.text and ri.IDENTITY_FILE in caplog.text
    assert ri.read(tmp_path) == (got.nonce, None)


def test_a_symlink_is_not_followed_nor_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ri.IDENTITY_FILE).symlink_to(victim)
    got = ri.establish(run)
    assert got.origin == "new"
    assert victim.read_text() == "keep me"
    assert not (run / ri.IDENTITY_FILE).is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another uid")
def test_a_file_of_another_user_is_not_trusted(tmp_path):
    planted = ri.new_nonce()
    path = tmp_path / ri.IDENTITY_FILE
    path.write_text(json.dumps({"format": ri.FORMAT, "version": 1, "nonce": planted}))
    os.chown(path, 65534, 65534)
    nonce, problem = ri.read(tmp_path)
    assert nonce is None and "uid 65534" in problem
    assert ri.establish(tmp_path).nonce != planted


def test_a_racing_start_uses_the_winners_identity(tmp_path, monkeypatch):
    winner = ri.new_nonce()

    def lose(final, data):  # another start published between our read and our link
        with open(final, "wb") as f:
            f.write(ri._doc(winner))
        return False

    monkeypatch.setattr(ri, "publish_bytes_if_absent", lose)
    assert ri.establish(tmp_path) == ri.RunIdentity(winner, "existing")


def test_a_full_run_dir_keeps_the_identity_in_memory(tmp_path, monkeypatch, caplog):
    """A full run directory never stops training (DESIGN: losing the run directory's disk
    never stops training): the identity lives in this attempt's memory, and the warning
    says what that costs. (The real full tmpfs: tests/unit/test_hostile_diskfull_train.py.)"""

    def full(final, data):
        raise OSError(errno.ENOSPC, "No space left on device", final)

    monkeypatch.setattr(ri, "publish_bytes_if_absent", full)
    with caplog.at_level(logging.WARNING, logger="steadytrain"):
        got = ri.establish(tmp_path)
    assert ri.is_nonce(got.nonce) and got.origin == "new"
    assert "No space left on device" in caplog.text
    assert "keeps its identity in memory" in caplog.text
