"""``steadytrain.Run``, the public entry of a training loop, in single processes: the plain
PyTorch loop of ``tests/integrations/plain_worker.py`` run alone, as a script.

- an exception inside the ``with`` ends the attempt with a crash ``job_end`` (the report
  lists it); the next start restores, its restore event is recorded after its
  ``job_start`` so ``restart_gap`` is above 0 and "other" stays small;
- the last step is committed when it is not a multiple of ``every_steps``;
- SIGTERM is a crash too (``signal: SIGTERM``, exit status 143), never a clean end;
- the rendezvous-store check, and configs given as dicts;
- one live job per run directory (issue 40, 3): a second job started on a live job's run
  directory is refused at entry, before it restored or wrote anything, naming the holder:
  a script with ``checkpoint=False``, and 2 ranks under torchrun with a checkpointer (every
  rank refused, rank 1 writes nothing either); a restart after the holder was SIGKILLed
  goes on.

The same loop under torchrun (a SIGKILLed rank, a hung rank): tests/integrations/
test_run_plain_pytorch.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from steadytrain.testing import forkserver
from steadytrain.testing.incidents.common import report as _report

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e", "train"))

from harness import make_dataset  # noqa: E402

from steadytrain.monitor.ledger import read_ledger  # noqa: E402
from steadytrain.run_support import agent_store_warning, meter_config  # noqa: E402

WORKER = os.path.join(HERE, "..", "integrations", "plain_worker.py")

pytestmark = pytest.mark.timeout(180)


# The second job of the two-job test as 2 ranks under the real torchrun (no --rdzv-id: a
# job of its own): every rank must be refused, and rank 1 must write nothing either.
TORCHRUN = ["-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0"]
TORCHRUN += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.2"]


def _cmd(data: str, run_dir: str, *args: str, attempt: int = 0, launch: tuple = ()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_RESTART_COUNT=str(attempt))
    # No job identity: two processes are two jobs (a shared one would be a restart).
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.pop("SLURM_JOB_ID", None)
    cmd = [sys.executable, *launch, WORKER, "--data", data, "--run-dir", run_dir, *args]
    return {"args": cmd, "env": env, "text": True}


def _run(
    data: str, run_dir: str, *args: str, attempt: int = 0, launch: tuple = ()
) -> subprocess.CompletedProcess:
    how = _cmd(data, run_dir, *args, attempt=attempt, launch=launch)
    # The script alone, or torchrun's agent (which starts its own fresh ranks), forked from an
    # interpreter that imported torch once (the fork server: a fresh one costs each call
    # seconds of CPU, and nothing here is about start-up).
    return forkserver.run(how["args"], env=how["env"], timeout=150)


def _start_holding(
    data: str, run_dir: str, hold: str, *args: str
) -> forkserver.ForkedProcess | subprocess.Popen:
    """A live job on ``run_dir``, holding after step 3 (its save and records on disk) until
    ``hold`` exists."""
    how = _cmd(data, run_dir, "--hold-at-step", "3", "--hold-file", hold, *args)
    proc = forkserver.popen(how["args"], env=how["env"])  # stdout and stderr in one pipe
    deadline = time.monotonic() + 120
    while not os.path.exists(hold + ".ready"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the first job never held:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    # No wait for its watchdog's "hold" phase file: a lone process publishes none (the phase
    # board is for holding other ranks, monitor/phases.py), and waiting for one cost each
    # test the whole 120 s deadline. Should one appear later, ``_tree`` sees it.
    return proc


# Files the holder's own live machinery rewrites: its leases' heartbeats, its watchdog.
LIVE = (".run-lease", "checkpoints/.writer-lease", "hangs/phases")


def _tree(run_dir: str) -> dict[str, str]:
    """Every file under ``run_dir`` with a digest of its bytes; ``LIVE`` files by name only."""
    out = {}
    for top, _dirs, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, run_dir)
            with open(path, "rb") as f:
                out[rel] = "" if rel.startswith(LIVE) else hashlib.sha1(f.read()).hexdigest()
    return out


def _committed(ckpt_dir: str) -> list[int]:
    from steadytrain.checkpoint.commit import parse_dirname

    return sorted(
        parse_dirname(n)[0]
        for n in os.listdir(ckpt_dir)
        if parse_dirname(n) and os.path.exists(os.path.join(ckpt_dir, n, "COMMIT"))
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("run-entry") / "ds"), max_bytes=100_000)


def test_exception_is_a_crash_and_the_restart_is_booked(data: str, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    crashed = _run(data, run_dir, "--steps", "10", "--every", "4", "--raise-at-step", "6")
    assert crashed.returncode == 1 and "user code failed in step 6" in crashed.stderr
    recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    end = recs[-1]
    assert end["type"] == "job_end" and end["step"] == 5, end
    assert end["reason"] == "error: ValueError: user code failed in step 6", end
    # No final save after a crash: the last commit is step 4 (every 4), not step 5.
    assert _committed(os.path.join(run_dir, "checkpoints")) == [4]

    resumed = _run(data, run_dir, "--steps", "10", "--every", "4", attempt=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    second = [i for i, r in enumerate(recs) if r["type"] == "job_start"][1]
    assert recs[second]["restored_step"] == 4 and recs[second]["startup_s"] > 0
    # The restore event is held until job_start opened the attempt: recorded before it, its
    # time would end the crashed attempt and swallow the restart gap.
    assert recs[second + 1]["type"] == "restore" and recs[second + 1]["step"] == 4
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
    # Its wait for that final save is booked as checkpoint time, not left to "other".
    assert recs[-1]["checkpoint_block_s"] > 0, recs[-1]
    # The last step is committed although 10 is not a multiple of every_steps = 4.
    assert _committed(os.path.join(run_dir, "checkpoints"))[-1] == 10
    assert any(r["type"] == "checkpoint" and r["ok"] and r["step"] == 10 for r in recs)

    rep = _report(run_dir)
    assert [(c["attempt"], c["reason"]) for c in rep["crashes"]] == [(0, end["reason"])]
    assert rep["restarts"] == 1
    badput = rep["badput"]
    assert badput["restart_gap"] > 0, badput
    assert badput["startup"] > 0, badput
    assert badput["other"] < 0.10, badput


def test_sigterm_is_a_crash_not_a_clean_end(data: str, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    proc = _run(data, run_dir, "--steps", "10", "--every", "4", "--sigterm-at-step", "3")
    assert proc.returncode == 128 + 15, (proc.returncode, proc.stderr[-3000:])
    recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "signal: SIGTERM", recs[-1]
    assert recs[-1]["step"] == 2
    # The next attempt starts, so the first one is no longer "maybe still running".
    assert _run(data, run_dir, "--steps", "4", "--every", "4", attempt=1).returncode == 0
    crashes = _report(run_dir)["crashes"]
    assert [(c["attempt"], c["reason"]) for c in crashes] == [(0, "signal: SIGTERM")]


def test_agent_store_check_names_the_fix() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    warning = agent_store_warning(shared)
    assert warning and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    assert "3 restart(s)" in warning
    # No restart allowed, or a fresh store per attempt: nothing to say.
    assert agent_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert agent_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert agent_store_warning({}) is None


def test_monitor_given_as_a_dict_reaches_the_watchdog() -> None:
    cfg = meter_config({"watchdog": {"floor_s": 7.0}, "flush_interval_s": 0.1})
    assert cfg.watchdog.floor_s == 7.0 and cfg.flush_interval_s == 0.1
    with pytest.raises(ValueError, match="floor_s"):
        meter_config({"watchdog": {"floor_s": -1.0}})


@pytest.mark.parametrize(
    "checkpoint, launch",
    [
        pytest.param(False, (), id="checkpoint-False"),
        # A torchrun end-to-end run: the inner loop (./run.sh quick) leaves it out.
        pytest.param(
            True, tuple(TORCHRUN), id="checkpointer-torchrun-2-ranks", marks=pytest.mark.e2e
        ),
    ],
)
def test_a_second_job_on_a_live_run_dir_is_refused_before_it_writes(
    data: str, tmp_path, checkpoint: bool, launch: tuple
) -> None:
    run_dir, hold = str(tmp_path / "run"), str(tmp_path / "go")
    args = ["--steps", "6", "--every", "2"] + ([] if checkpoint else ["--no-checkpoint"])
    first = _start_holding(data, run_dir, hold, *args)
    try:
        before = _tree(run_dir)
        assert "ledger.jsonl" in before and ".run-lease/00000001.json" in before
        assert ("checkpoints/step-00000002/COMMIT" in before) == checkpoint
        second = _run(data, run_dir, *args, launch=launch)
        err = second.stderr
        assert second.returncode == 1, err[-3000:]
        refused = err.count("steadytrain.errors.RunDirInUseError: ")
        assert refused == (2 if launch else 1), err[-6000:]  # every rank
        # The holder by host, pid and lease file, and the fix.
        assert f"host {socket.gethostname()} pid {first.pid} job (no job id)" in err, err
        assert os.path.join(run_dir, ".run-lease", "00000001.json") in err, err
        assert "Fix: stop that job, or give this job its own run_dir" in err, err
        # Refused before anything: no restore, no record, no rank file, no checkpoint.
        assert _tree(run_dir) == before
    finally:
        open(hold, "w").close()
        out = first.communicate(timeout=150)[0]
    assert first.returncode == 0, out[-3000:]
    # The first job's report is its own: no invented crash, no time claimed twice.
    rep = _report(run_dir)
    assert rep["crashes"] == [] and rep["restarts"] == 0 and rep["last_step"] == 6, rep
    assert not rep.get("overbooked_s"), rep
    # Released at its end: the next job starts at once.
    assert _run(data, run_dir, *args).returncode == 0


def test_a_restart_after_the_holder_was_sigkilled_goes_on(data: str, tmp_path) -> None:
    run_dir, hold = str(tmp_path / "run"), str(tmp_path / "go")
    args = ["--steps", "6", "--every", "2"]
    first = _start_holding(data, run_dir, hold, *args)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=60)
    resumed = _run(data, run_dir, *args, attempt=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    starts = [r for r in recs if r["type"] == "job_start"]
    assert [s["restored_step"] for s in starts] == [0, 2], starts
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
    lease = json.loads(open(os.path.join(run_dir, ".run-lease", "00000002.json")).read())
    assert lease["took_over"] == f"its process {first.pid} on this host is gone", lease
    assert lease["released"] is True
