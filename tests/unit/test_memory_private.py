"""The memory tier restores only this run's own snapshots, written by this user (issue 40, 2).

One process, no gloo. Another user is played by root (``os.chown`` to uid 65534), so those
cases run as root only. What is checked:

- the default directory is per user (``/dev/shm/steadytrain-<uid>``; here under a stand-in
  for /dev/shm) and everything the tier makes is 0700 / 0600;
- a directory the tier would use that is not this user's alone (another owner, a symlink,
  group/other permissions; a shared directory without the sticky bit) turns the tier off
  with one record naming it and the fix, and training and durable checkpoints go on;
- a planted symlink, hard link or temporary file is never written through (``O_NOFOLLOW``,
  ``O_EXCL``, one link), in a folder an attacker pre-created or in the tier's own;
- a snapshot of another run (another nonce: a reused checkpoint path) or of another owner is
  never restored, and the restore event's ``skipped`` says why;
- a tmpfs full for ``FULL_GENERATIONS`` generations in a row turns the tier off, once.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.memory import private
from steadytrain.checkpoint.memory.config import ENV_DIR, MemoryConfig
from steadytrain.checkpoint.memory.store import store_key
from steadytrain.checkpoint.memory.tier import FULL_GENERATIONS

ATTACKER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another uid's files")


@pytest.fixture
def shm(tmp_path, monkeypatch) -> str:
    """A stand-in for /dev/shm (mode 1777, as it is): the default directory goes under it."""
    path = tmp_path / "shm"
    path.mkdir()
    os.chmod(path, 0o1777)
    monkeypatch.setattr(private, "SHM", str(path))
    monkeypatch.delenv(ENV_DIR, raising=False)
    return str(path)


def _states() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def _checkpointer(tmp_path, events: list, **memory) -> Checkpointer:
    return Checkpointer(
        str(tmp_path / "ck"),
        every_steps=2,
        async_mode="sync",
        job_id="unit",
        memory={"every_steps": 1, **memory},
        on_event=events.append,
    )


def _train(ck: Checkpointer, states: dict, steps: range) -> None:
    for step in steps:
        with torch.no_grad():
            states["model"].weight.add_(1.0)
        ck.maybe_save(step, states)
    ck.wait()


def _snapshots_of(tmp_path, steps: int, **memory) -> list[dict]:
    """A job that snapshots every step for ``steps`` steps, then closes: its
    ``memory_snapshot`` events."""
    events: list[dict] = []
    ck = _checkpointer(tmp_path, events, **memory)
    _train(ck, _states(), range(1, steps + 1))
    ck.close()
    return [e for e in events if e["type"] == "memory_snapshot"]


def _mkdir(path, mode: int, uid: int | None = None) -> str:
    os.makedirs(path)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)
    return str(path)


def _key_dir(tmp_path, base: str) -> str:
    """Where the tier keeps this job's snapshots: predictable, so an attacker knows it too."""
    return os.path.join(base, store_key("unit", str(tmp_path / "ck")))


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_directory_is_per_user_and_private(tmp_path, shm):
    assert MemoryConfig().resolved_dir() == os.path.join(shm, f"steadytrain-{os.geteuid()}")
    events: list[dict] = []
    ck = _checkpointer(tmp_path, events)
    _train(ck, _states(), range(1, 3))
    base = os.path.join(shm, f"steadytrain-{os.geteuid()}")
    key = _key_dir(tmp_path, base)
    owner = os.path.join(key, "rank00000")
    for d in (base, key, owner):
        assert _mode(d) == 0o700 and os.lstat(d).st_uid == os.geteuid(), d
    names = sorted(os.listdir(owner))
    assert names == ["step-000000001.snap", "step-000000002.snap"], names
    assert all(_mode(os.path.join(owner, n)) == 0o600 for n in names)
    assert [e["ok"] for e in events if e["type"] == "memory_snapshot"] == [True, True]
    ck.close()


def _another_owner(base: str, tmp_path) -> str:
    os.mkdir(base)
    os.chmod(base, 0o777)
    os.chown(base, ATTACKER, ATTACKER)
    return "owned by uid 65534"


def _a_symlink(base: str, tmp_path) -> str:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, base)
    return "is a symbolic link"


def _open_to_others(base: str, tmp_path) -> str:
    os.mkdir(base)
    os.chmod(base, 0o755)
    return "has mode 0755"


@pytest.mark.parametrize(
    "make",
    [pytest.param(_another_owner, marks=as_root), _a_symlink, _open_to_others],
    ids=["another-owner", "symlink", "group-other-permissions"],
)
def test_an_unsafe_default_directory_turns_the_tier_off_with_one_record(tmp_path, shm, make):
    base = os.path.join(shm, f"steadytrain-{os.geteuid()}")
    why = make(base, tmp_path)
    before = sorted(os.listdir(base))
    events: list[dict] = []
    ck = _checkpointer(tmp_path, events)
    states = _states()
    _train(ck, states, range(1, 5))
    ck.close()
    snaps = [e for e in events if e["type"] == "memory_snapshot"]
    assert len(snaps) == 1 and not snaps[0]["ok"], snaps  # one record, then off
    error = snaps[0]["error"]
    assert base in error and why in error and "Fix:" in error and "training" in error, error
    durable = [(e["step"], e["ok"]) for e in events if e["type"] == "checkpoint"]
    assert durable == [(2, True), (4, True)]  # training and durable checkpoints went on
    assert sorted(os.listdir(base)) == before  # nothing was made or written in it
    again = _checkpointer(tmp_path, [])
    assert again.restore_latest(_states()) == 4 and again.last_event["tier"] == "durable"
    assert why in again.last_event["skipped"][0]["reason"]


@as_root
def test_a_job_folder_made_by_another_user_under_a_shared_directory_is_refused(tmp_path):
    shared = _mkdir(tmp_path / "shared", 0o1777)  # shared by every user, like /dev/shm
    key = _mkdir(_key_dir(tmp_path, shared), 0o777, ATTACKER)
    snaps = _snapshots_of(tmp_path, 2, dir=shared)
    assert [s["ok"] for s in snaps] == [False] and key in snaps[0]["error"]
    assert "owned by uid 65534" in snaps[0]["error"] and os.listdir(key) == []


def test_a_shared_directory_without_the_sticky_bit_is_refused(tmp_path):
    open_dir = _mkdir(tmp_path / "open", 0o777)  # anyone could swap the job's folder
    snaps = _snapshots_of(tmp_path, 2, dir=open_dir)
    assert [s["ok"] for s in snaps] == [False]
    assert "without the sticky bit" in snaps[0]["error"] and "chmod +t" in snaps[0]["error"]
    assert os.listdir(open_dir) == []


def _secret(path) -> bytes:
    data = b"an unrelated file: " + os.fsencode(path)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
    return data


@as_root
def test_a_planted_world_writable_folder_with_symlinks_is_never_written_through(tmp_path):
    """Issue 40's reproduction: another user pre-creates the job's folder, world-writable,
    with the temporary name the job will use linked to an unrelated 0600 file, and a
    snapshot name linked to a file of their own."""
    shared = _mkdir(tmp_path / "shared", 0o1777)
    owner_dir = os.path.join(_mkdir(_key_dir(tmp_path, shared), 0o777), "rank00000")
    os.mkdir(owner_dir)
    victim, theirs = tmp_path / "victim", tmp_path / "theirs"
    secret = _secret(victim)
    theirs.write_bytes(b"")
    os.chown(theirs, ATTACKER, ATTACKER)
    os.symlink(victim, os.path.join(owner_dir, f"next.tmp-{os.getpid()}"))
    os.symlink(theirs, os.path.join(owner_dir, "step-000000000.snap"))
    for d in (owner_dir, os.path.dirname(owner_dir)):
        os.chmod(d, 0o777)
        os.chown(d, ATTACKER, ATTACKER)
    snaps = _snapshots_of(tmp_path, 3, dir=shared)
    assert victim.read_bytes() == secret  # never written through
    assert theirs.read_bytes() == b""  # never received the job's state
    assert [e["ok"] for e in snaps] == [False]


def test_planted_links_in_the_tiers_own_folder_are_never_written_through(tmp_path):
    """Even inside a folder that passed its checks (planted before it was checked, or by
    root): a symlink under the temporary name, under an old snapshot's name and under a
    newer one's, and a hard link to a file elsewhere are removed, never opened for writing;
    retention still keeps two generations of the job's own copies."""
    events: list[dict] = []
    states = _states()
    mem = str(tmp_path / "mem")
    ck = _checkpointer(tmp_path, events, dir=mem)
    _train(ck, states, range(1, 2))
    owner_dir = os.path.join(_key_dir(tmp_path, mem), "rank00000")
    victims = [tmp_path / f"victim{i}" for i in range(3)]
    secrets = [_secret(v) for v in victims]
    os.symlink(victims[0], os.path.join(owner_dir, f"next.tmp-{os.getpid()}"))
    os.symlink(victims[1], os.path.join(owner_dir, "step-000000000.snap"))
    os.link(victims[2], os.path.join(owner_dir, "step-000000000.snap.tmp-77"))
    # named as the newest copy: kept as such, it would make every generation recycle the
    # newest copy of ours (one generation instead of two)
    os.symlink(victims[0], os.path.join(owner_dir, "step-000000099.snap"))
    _train(ck, states, range(2, 5))
    assert [v.read_bytes() for v in victims] == secrets
    assert all(e["ok"] for e in events if e["type"] == "memory_snapshot"), events
    assert sorted(os.listdir(owner_dir)) == ["step-000000003.snap", "step-000000004.snap"]
    again = _checkpointer(tmp_path, [], dir=mem)
    assert again.restore_latest(_states()) == 4 and again.last_event["tier"] == "local-memory"
    ck.close()


def test_a_reused_checkpoint_path_never_restores_the_old_runs_snapshots(tmp_path):
    """A run killed at step 3, its directory removed, a new run under the same path and job:
    the old run's snapshots are still in memory, under the same folder, and are passed over
    by name (another nonce), never restored."""
    mem = str(tmp_path / "mem")
    events: list[dict] = []
    _train(_checkpointer(tmp_path, events, dir=mem), _states(), range(1, 4))  # killed
    shutil.rmtree(tmp_path / "ck")  # rm -rf RUN: the durable checkpoints and the identity
    events = []
    new = _checkpointer(tmp_path, events, dir=mem)
    assert new.restore_latest(_states()) == 0  # a fresh start, not step 3 from memory
    (restore,) = [e for e in events if e["type"] == "restore"]
    why = {s["step"]: s["reason"] for s in restore["skipped"] if "rank00000" in s["path"]}
    assert sorted(why) == [2, 3], restore["skipped"]
    assert all("written by another run (nonce" in r for r in why.values()), why
    new.close()


@as_root
def test_a_snapshot_of_another_owner_is_never_read(tmp_path):
    mem = str(tmp_path / "mem")
    events: list[dict] = []
    _train(_checkpointer(tmp_path, events, dir=mem), _states(), range(1, 4))  # killed
    owner_dir = os.path.join(_key_dir(tmp_path, mem), "rank00000")
    planted = os.path.join(owner_dir, "step-000000003.snap")  # valid, this run's, not ours
    os.chown(planted, ATTACKER, ATTACKER)
    events = []
    again = _checkpointer(tmp_path, events, dir=mem)
    assert again.restore_latest(_states()) == 2  # the older generation (memory wins a tie)
    (restore,) = [e for e in events if e["type"] == "restore"]
    assert restore["tier"] == "local-memory"
    (why,) = [s["reason"] for s in restore["skipped"] if s["path"] == planted]
    assert "not owned by this user (owner uid 65534" in why, why


def _fill(path: str) -> None:
    """Take every free byte of ``path``'s file system."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass


def test_a_tmpfs_full_for_n_generations_turns_the_tier_off_once(tmp_path, caplog):
    from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

    try:
        with tmpfs(tmp_path / "mem", "256k") as mem:
            events: list[dict] = []
            # the budget passes (given); the room is taken after the start, by others
            ck = _checkpointer(tmp_path, events, dir=mem, budget_bytes=1 << 30)
            _fill(os.path.join(mem, "someone-elses"))
            with caplog.at_level(logging.WARNING, logger="steadytrain.checkpoint"):
                _train(ck, _states(), range(1, FULL_GENERATIONS + 4))
            ck.close()
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))
    snaps = [e for e in events if e["type"] == "memory_snapshot"]
    assert [e["ok"] for e in snaps] == [False] * (FULL_GENERATIONS + 1), snaps
    assert all("No space left" in e["error"] for e in snaps[:FULL_GENERATIONS])
    off = snaps[-1]["error"]
    assert f"full for the last {FULL_GENERATIONS} generations in a row" in off, off
    assert "memory tier is off for this run" in off
    said = [r.getMessage() for r in caplog.records]
    assert sum("memory snapshot of step" in m for m in said) == 1, said  # not every step
    assert sum("full for the last" in m for m in said) == 1, said
    assert [e["ok"] for e in events if e["type"] == "checkpoint"] == [True] * 3


@as_root
def test_a_given_directory_of_another_user_is_refused(tmp_path):
    theirs = _mkdir(tmp_path / "theirs", 0o755, ATTACKER)  # its owner can rename anything in it
    snaps = _snapshots_of(tmp_path, 2, dir=theirs)
    assert [s["ok"] for s in snaps] == [False] and "owned by uid 65534" in snaps[0]["error"]
    assert os.listdir(theirs) == []
