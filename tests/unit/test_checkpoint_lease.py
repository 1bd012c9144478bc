"""Checkpoint writer safety in one process: the writer lease's rules, directory claims, and
the "No space left on device" label (issue 12 items 1 and 4); the same lease rules for a run
directory, which ``steadytrain.Run`` takes at entry (issue 40, 3).

Lease records of other jobs are written here by hand, exactly as another process would
write them (docs/format.md), with real pids: a live child process, then the same pid once it
was reaped. The two-process tests are in tests/distributed/test_checkpoint_lease.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint import lease as L
from steadytrain.checkpoint.claim import claim_name
from steadytrain.checkpoint.identity import host_identity, job_identity, proc_start
from steadytrain.checkpoint.remote import Root
from steadytrain.checkpoint.writer import _explain
from steadytrain.errors import CheckpointError
from steadytrain.storage.store import Store


def _states(value: float) -> dict:
    model = nn.Linear(8, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


def _holder(root, generation: int = 1, kind: L.LeaseKind = L.WRITER, **fields) -> dict:
    """Write generation ``generation`` of ROOT's ``kind`` lease as another job would."""
    rec = {
        "format": kind.format,
        "version": L.VERSION,
        **host_identity(),
        "pid": 0,
        "pid_start": None,
        "job": "torchelastic:other",
        "timeout_s": 300.0,
        "generation": generation,
        "token": "theirs",
        "acquired": time.time(),
        "heartbeat": time.time(),
        "released": False,
    } | fields
    d = root / kind.dirname
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{generation:08d}.json").write_text(json.dumps(rec))
    return rec


def _newest(root, kind: L.LeaseKind = L.WRITER) -> dict:
    gens = sorted((root / kind.dirname).glob("*.json"))
    return json.loads(gens[-1].read_text())


@pytest.fixture
def sleeper():
    """A live process of this host (a real pid that is not ours)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_a_live_job_on_this_host_is_refused_and_freed_once_its_process_is_gone(tmp_path, sleeper):
    start = proc_start(sleeper.pid)[1]
    _holder(tmp_path, pid=sleeper.pid, pid_start=start)
    ckpt = Checkpointer(str(tmp_path), async_mode="sync")
    with pytest.raises(CheckpointError) as err:
        ckpt.save(1, _states(1.0))
    msg = str(err.value)
    assert str(tmp_path) in msg and f"pid {sleeper.pid}" in msg
    assert "job torchelastic:other" in msg and "Fix: stop that job" in msg
    assert not list(tmp_path.glob("step-*")), "a refused job writes nothing"
    sleeper.kill()
    sleeper.wait()  # reaped: the pid is gone from this host
    ckpt.save(1, _states(1.0))
    assert ckpt.last_event["ok"]
    rec = _newest(tmp_path)
    assert rec["generation"] == 2 and rec["pid"] == os.getpid()
    assert f"process {sleeper.pid} on this host is gone" in rec["took_over"]
    ckpt.close()
    assert _newest(tmp_path)["released"] is True


def test_a_reused_pid_is_not_the_holder(tmp_path, sleeper):
    _holder(tmp_path, pid=sleeper.pid, pid_start="1")  # that pid, started at another time
    ckpt = Checkpointer(str(tmp_path), async_mode="sync")
    ckpt.save(1, _states(1.0))
    assert ckpt.last_event["ok"] and "is gone" in _newest(tmp_path)["took_over"]
    ckpt.close()


def test_the_same_job_identity_takes_over_at_once(tmp_path, sleeper, monkeypatch):
    _holder(tmp_path, pid=sleeper.pid, pid_start=proc_start(sleeper.pid)[1], job="torchelastic:j1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "j1")
    ckpt = Checkpointer(str(tmp_path), async_mode="sync")
    ckpt.save(1, _states(1.0))
    assert ckpt.last_event["ok"] and "same job" in _newest(tmp_path)["took_over"]
    ckpt.close()


def test_job_identity_sources(monkeypatch):
    assert job_identity("mine") == "mine"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: every job has it
    assert job_identity() == ""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert job_identity() == "slurm:77"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r9")
    assert job_identity() == "torchelastic:r9"


def test_another_hosts_job_is_refused_until_its_heartbeat_is_older_than_the_timeout(tmp_path):
    _holder(tmp_path, host="node-17", pid=4242, heartbeat=time.time() - 100)
    ckpt = Checkpointer(str(tmp_path), async_mode="sync", lease_timeout_s=300)
    with pytest.raises(CheckpointError, match=r"host node-17 pid 4242.*heartbeat 10\d s ago"):
        ckpt.save(1, _states(1.0))
    with pytest.raises(CheckpointError, match=r"expires when its heartbeat is 300 s old"):
        ckpt.save(1, _states(1.0))
    _holder(tmp_path, host="node-17", pid=4242, heartbeat=time.time() - 301)
    ckpt.save(1, _states(1.0))
    assert ckpt.last_event["ok"] and "heartbeat is 301 s old" in _newest(tmp_path)["took_over"]
    ckpt.close()


def test_checkpointers_of_one_process_share_the_lease(tmp_path):
    a = Checkpointer(str(tmp_path), async_mode="sync")
    b = Checkpointer(str(tmp_path), async_mode="sync")
    a.save(1, _states(1.0))
    b.save(2, _states(2.0))
    a.save(3, _states(3.0))
    assert [c.last_event["ok"] for c in (a, b)] == [True, True]
    assert len(list((tmp_path / L.LEASE_DIR).glob("*.json"))) == 1
    a.close()
    assert _newest(tmp_path)["released"] is False  # b still holds it
    b.close()
    assert _newest(tmp_path)["released"] is True


def test_a_job_that_lost_its_lease_stops_saving_and_deletes_nothing(tmp_path):
    events: list[dict] = []
    ckpt = Checkpointer(str(tmp_path), async_mode="sync", keep_last=2, on_event=events.append)
    for step in (1, 2, 3):
        ckpt.save(step, _states(step))
    before = sorted(p.name for p in tmp_path.glob("step-*"))
    _holder(tmp_path, generation=_newest(tmp_path)["generation"] + 1, host="node-9", pid=99)
    ckpt.save(4, _states(4.0))  # the fence: this save fails, nothing is claimed or deleted
    assert events[-1]["ok"] is False and events[-1]["lease_lost"] is True
    assert "lost the checkpoint writer lease to host node-9 pid 99" in events[-1]["error"]
    with pytest.raises(CheckpointError, match="lost the checkpoint writer lease"):
        ckpt.save(5, _states(5.0))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == before


def test_concurrent_claims_never_share_a_directory(tmp_path):
    """Two writers claim the same steps at the same moment: every name goes to one only."""
    roots = [Root(str(tmp_path)), Root(str(tmp_path))]
    got: list[list[str]] = [[], []]
    gate = threading.Barrier(2)

    def run(i: int) -> None:
        for step in range(1, 31):
            gate.wait()
            got[i].append(claim_name(roots[i], None, step))

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got[0]) | set(got[1])) == 60  # no name claimed twice
    assert all((tmp_path / n).is_dir() for n in got[0] + got[1])


def test_create_if_absent_on_a_local_root(tmp_path):
    store = Store(str(tmp_path))
    assert store.write_bytes_if_absent("a/CLAIM", b"first") is True
    assert store.write_bytes_if_absent("a/CLAIM", b"second") is False
    assert (tmp_path / "a" / "CLAIM").read_bytes() == b"first"
    assert os.listdir(tmp_path / "a") == ["CLAIM"]  # no temporary file left behind


# -- the "No space left on device" label (issue 12 item 4) ---------------------------------
def _wrapped(exc: BaseException, how: str) -> BaseException:
    try:
        try:
            raise exc
        except OSError as inner:
            if how == "cause":
                raise RuntimeError("save failed") from inner
            raise RuntimeError("save failed")  # noqa: B904 - __context__ on purpose
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("how", ["cause", "context"])
def test_enospc_and_edquot_inside_another_error_are_labelled(tmp_path, how):
    path = str(tmp_path / "step-00000001")
    full = _wrapped(OSError(errno.ENOSPC, "No space left on device"), how)
    assert _explain(full, path, 1000).startswith("No space left on device:")
    quota = _wrapped(OSError(errno.EDQUOT, "Disk quota exceeded"), how)
    msg = _explain(quota, path, 1000)
    assert msg.startswith("Disk quota exceeded:") and "raise the quota" in msg


def test_enospc_of_one_rank_inside_dcps_checkpoint_exception_is_labelled(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    exc = CheckpointException("write", {1: (OSError(errno.ENOSPC, "full"), [])})
    assert _explain(exc, str(tmp_path / "s"), 10).startswith("No space left on device")


def test_low_free_space_alone_does_not_relabel_an_unrelated_error(tmp_path):
    # Far more than any disk holds: the old rule called every failure "No space left".
    exc = ValueError("state dict key 'model.w' has an unsupported type")
    msg = _explain(exc, str(tmp_path / "step-00000001"), 1 << 60)
    assert msg == "ValueError: state dict key 'model.w' has an unsupported type"


def test_a_short_write_on_a_disk_with_room_is_not_called_a_full_disk(tmp_path):
    exc = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    msg = _explain(exc, str(tmp_path / "step-00000001"), 4096)
    assert "No space" not in msg and "not a full disk" in msg
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".space-probe")]


# -- the run directory's lease (steadytrain.Run, run_lease.py) -----------------------------
def _run_dir_files(run_dir) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def test_run_refuses_a_run_dir_held_by_another_hosts_live_job_until_its_lease_expires(tmp_path):
    from steadytrain import Run
    from steadytrain.errors import RunDirInUseError

    run_dir = tmp_path / "run"
    old = time.time() - 100
    _holder(run_dir, kind=L.RUN_LEASE, host="node-17", pid=4242, heartbeat=old, timeout_s=30.0)
    with pytest.raises(RunDirInUseError) as err:
        Run(run_dir, {}, checkpoint=False).__enter__()
    msg = str(err.value)
    assert "is the run directory of another live job: host node-17 pid 4242" in msg
    assert str(run_dir / ".run-lease" / "00000001.json") in msg and "heartbeat 10" in msg
    assert "expires when its heartbeat is 300 s old (in about 20" in msg, msg
    assert _run_dir_files(run_dir) == [".run-lease/00000001.json"]  # nothing written
    # The checkpoint's lease_timeout_s is the run lease's too: 100 s is past a 60 s limit.
    checkpoint = {"lease_timeout_s": 60.0, "async_mode": "sync"}
    with Run(run_dir, {"m": nn.Linear(2, 2)}, checkpoint=checkpoint) as run:
        run.step_done(1)
    rec = _newest(run_dir, L.RUN_LEASE)
    assert rec["took_over"] == "its heartbeat is 100 s old (limit 60 s)", rec
    assert rec["format"] == "steadytrain-run-lease" and rec["released"] is True


def test_run_takes_over_from_its_own_job_and_from_a_gone_process(tmp_path, sleeper, monkeypatch):
    from steadytrain import Run

    live = proc_start(sleeper.pid)[1]
    _holder(tmp_path, kind=L.RUN_LEASE, pid=sleeper.pid, pid_start=live, job="torchelastic:j1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "j1")  # torchrun's restart of that job
    with Run(tmp_path, {}, checkpoint=False):
        pass
    assert _newest(tmp_path, L.RUN_LEASE)["took_over"] == "same job (torchelastic:j1): a restart"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    gen = _newest(tmp_path, L.RUN_LEASE)["generation"] + 1
    _holder(tmp_path, gen, kind=L.RUN_LEASE, pid=sleeper.pid, pid_start=live)
    sleeper.kill()
    sleeper.wait()
    with Run(tmp_path, {}, checkpoint=False):
        pass
    assert "is gone" in _newest(tmp_path, L.RUN_LEASE)["took_over"]


def test_run_lease_heartbeats_while_the_run_is_open(tmp_path):
    from steadytrain import Run

    with Run(tmp_path, {}, checkpoint={"lease_timeout_s": 1.0}):  # a beat every 0.1 s
        first = _newest(tmp_path, L.RUN_LEASE)
        deadline = time.monotonic() + 30
        while _newest(tmp_path, L.RUN_LEASE)["heartbeat"] == first["heartbeat"]:
            assert time.monotonic() < deadline, "the run lease's heartbeat never moved"
            time.sleep(0.05)
    assert _newest(tmp_path, L.RUN_LEASE)["released"] is True


def test_run_goes_on_with_a_warning_when_it_cannot_write_its_lease(tmp_path):
    from steadytrain import Run

    (tmp_path / ".run-lease").write_text("not a directory")  # the lease cannot be written
    said: list[str] = []
    with Run(tmp_path, {}, checkpoint=False, say=said.append) as run:
        run.step_done(1)
    assert any("could not take the run directory lease" in m for m in said), said
    assert (tmp_path / "ledger.jsonl").exists()
