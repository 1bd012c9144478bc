"""The reaper (monitor/reaper.py): its policy on explicit clock values, then real processes:
a SIGSTOPped "rank" is SIGKILLed and the kill published, a SIGTERM to a stopped rank's group
kills it, nothing but the parent is ever killed, the reaper never outlives its rank, and a
decision file that is not this job's own (forged, another run's, naming ranks the job never
had, another user's) kills nothing. Waits only bound a failure; nothing asserts how fast
this machine is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from steadytrain.monitor.hangs import RECORDED, hang_dir, publish_decision
from steadytrain.monitor.reaper import DECISION, Reaper, proc_state, reaped_path

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


NONCE = "5e" * 16  # the run's identity (run_identity.py), as Run hands it to the reapers


def _decision(
    d, rank: int, stuck: list[int], missing: list[int], attempt: int = 0, nonce: str = NONCE
) -> None:
    d.mkdir(parents=True, exist_ok=True)
    cause = "no response" if missing else "not in a collective"
    publish_decision(
        d, rank, attempt, {"stuck_ranks": stuck, "missing_ranks": missing, "cause": cause}, nonce
    )


def _reaper(d, rank: int = 1, **kw) -> Reaper:
    me = proc_state(os.getpid())
    args = dict(rank=rank, node="node-1", attempt=0, world_size=2, nonce=NONCE,
                parent=os.getpid(), parent_start=me.start, since=time.time(),
                record_wait_s=10.0, backstop_s=40.0)  # fmt: skip
    args.update(kw)
    return Reaper(d, **args)


# -- /proc ------------------------------------------------------------------------------
def test_proc_state_reads_state_and_start_time() -> None:
    me = proc_state(os.getpid())
    assert me is not None and me.state == "R" and me.start > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while proc_state(child.pid).state != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc_state(child.pid).state == "T"
    finally:
        child.kill()
        child.wait()
    assert proc_state(child.pid) is None  # gone (and reaped)


# -- the policy --------------------------------------------------------------------------
def test_nothing_happens_without_a_decision(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    r = _reaper(d)
    assert r.reason(0.0, "T", r.decisions()) is None  # stopped, but no hang decided
    d.mkdir(parents=True)
    (d / "rank-0.json").write_text("{}")  # a verdict is no decision
    assert r.decisions() == [] and r.reason(100.0, "T", []) is None


def test_a_stopped_rank_is_killed_once_rank_0_recorded_or_waited(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    _decision(d, 0, stuck=[1], missing=[1])
    r = _reaper(d, record_wait_s=10.0)
    decided = r.decisions()
    assert [x["stuck_ranks"] for x in decided] == [[1]]
    assert r.reason(100.0, "T", decided) is None  # rank 0 is still writing the record
    assert r.reason(109.0, "T", decided) is None
    assert r.reason(110.0, "T", decided) == "stopped"  # rank 0's record took too long
    r2 = _reaper(d)
    (d / RECORDED).write_text("{}")
    assert r2.reason(5.0, "T", decided) == "stopped"  # the record is on disk: at once
    assert r2.reason(5.0, "t", decided) == "stopped"  # a debugger's stop: the same


def test_a_silent_running_rank_is_killed_but_one_that_answered_exits_itself(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    _decision(d, 0, stuck=[1], missing=[1])
    (d / RECORDED).write_text("{}")
    r = _reaper(d, backstop_s=40.0)
    decided = r.decisions()
    # No verdict of its own: its watchdog thread cannot run (GIL held in C, kernel wait).
    assert r.reason(0.0, "R", decided) == "no response"
    assert r.reason(0.0, "D", decided) == "no response"
    (d / "rank-1.json").write_text("{}")  # it answered: the watchdog's os._exit ends it
    assert r.reason(1.0, "S", decided) is None
    assert r.reason(39.9, "R", decided) is None
    assert r.reason(40.0, "R", decided) == "backstop"  # it never did


def test_a_waiting_rank_is_left_to_its_own_exit_until_the_backstop(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    _decision(d, 1, stuck=[1], missing=[])
    (d / "rank-0.json").write_text("{}")
    r = _reaper(d, rank=0, backstop_s=25.0)
    assert r.reason(0.0, "S", r.decisions()) is None  # rank 0 waits, writes the record
    assert r.reason(25.0, "S", r.decisions()) == "backstop"


def test_a_silent_rank_0_is_killed_at_once(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    _decision(d, 1, stuck=[0], missing=[0])  # rank 0 cannot record: nobody waits for it
    r = _reaper(d, rank=0)
    assert r.reason(0.0, "T", r.decisions()) == "stopped"


def test_stale_foreign_and_malformed_decisions_are_ignored(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    _decision(d, 0, stuck=[1], missing=[1], attempt=1)  # another attempt's
    (d / DECISION.format(rank=2)).write_text("not json")
    (d / DECISION.format(rank=3)).write_text(json.dumps({"attempt": 0, "t": time.time()}))
    old = {"attempt": 0, "t": time.time() - 3600, "stuck_ranks": [1], "missing_ranks": [1]}
    (d / DECISION.format(rank=4)).write_text(json.dumps(old))  # an earlier run's
    os.symlink(d / DECISION.format(rank=4), d / DECISION.format(rank=5))
    r = _reaper(d)
    assert r.decisions() == []


def _forge(d, name: str, **fields) -> None:
    """A decision file as someone other than the job's ranks could drop it."""
    d.mkdir(parents=True, exist_ok=True)
    doc = {"rank": 0, "attempt": 0, "t": time.time(), "stuck_ranks": [1], "missing_ranks": [1],
           "cause": "no response", "nonce": NONCE, **fields}  # fmt: skip
    (d / name).write_text(json.dumps(doc))


def test_a_decision_that_is_not_this_jobs_own_kills_nothing(tmp_path) -> None:
    """Forged decisions name the parent (rank 1) stuck and silent, with rank 0's record on
    disk: what a real decision needs to kill at once. None of them is the job's own."""
    d = hang_dir(tmp_path, 0)
    _forge(d, DECISION.format(rank=0), nonce="0" * 32)  # another run's (or a guess)
    _forge(d, DECISION.format(rank=1), nonce=None)  # no identity at all
    _forge(d, DECISION.format(rank=5), rank=5, stuck_ranks=[1, 7])  # ranks the job never had
    _forge(d, "decision-3.json", rank=0)  # rank 0's decision under another rank's name
    (d / RECORDED).write_text("{}")
    killed: list[int] = []
    r = _reaper(d, kill=lambda pid, start: killed.append(pid) or True, getppid=os.getpid)
    assert r.decisions() == []
    for when in (0.0, 100.0):  # at once, and long past the backstop
        assert r.reason(when, "S", r.decisions()) is None
        assert r.reason(when, "T", r.decisions()) is None  # even a stopped parent
    assert r.tick() is False and killed == [] and r.reaped is None
    assert set(r.refused) == {f"decision-{i}.json" for i in (0, 1, 3, 5)}, r.refused
    assert "nonce" in r.refused["decision-0.json"] and "nonce" in r.refused["decision-1.json"]
    assert "outside the job's 2 ranks" in r.refused["decision-5.json"]
    assert "in the file decision-3.json" in r.refused["decision-3.json"]
    # The job's own decision beside them is acted on: the checks refuse the forged only.
    _decision(d, 0, stuck=[1], missing=[1])
    assert [x["rank"] for x in r.decisions()] == [0]
    assert r.reason(0.0, "T", r.decisions()) == "stopped"


def test_a_decision_file_of_another_user_kills_nothing(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another user needs root")
    d = hang_dir(tmp_path, 0)
    _decision(d, 0, stuck=[1], missing=[1])  # right in every field...
    os.chown(d / DECISION.format(rank=0), 65534, 65534)  # ...but written by someone else
    r = _reaper(d)
    assert r.decisions() == [] and r.reason(100.0, "T", []) is None
    assert "owned by this user" in r.refused["decision-0.json"]


# -- real processes -----------------------------------------------------------------------
# A "rank": starts its reaper as the watchdog does (the run's nonce argv[5]), says the
# reaper's pid, then SIGSTOPs itself (argv[2] == "stop") or sleeps argv[3] seconds and
# exits (argv[2] == "exit"). argv[4]: the reaper's backstop.
RANK = """
import os, signal, sys, time
from steadytrain.monitor.reaper import spawn
p = spawn(sys.argv[1], rank=1, node="node-1", attempt=0, world_size=2, nonce=sys.argv[5],
          poll_s=0.05, idle_s=0.05, record_wait_s=30.0, backstop_s=float(sys.argv[4]))
print(p.pid, flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
time.sleep(float(sys.argv[3]))
"""


def _start_rank(
    d, mode: str, linger: float = 0.0, backstop: float = 60.0
) -> tuple[subprocess.Popen, int]:
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, str(d), mode, str(linger), str(backstop), NONCE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as torchrun starts its workers: a group of their own
    )
    return rank, int(rank.stdout.readline())


def _wait_sigterm_caught(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` (the reaper, still starting) has its SIGTERM handler installed."""
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(x.split()[1], 16) for x in f if x.startswith("SigCgt:"))
        if caught & bit:
            return
        time.sleep(0.02)
    raise AssertionError(f"reaper {pid} never installed its SIGTERM handler")


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = proc_state(pid)
        if st is None or st.state in "ZX":
            return True
        time.sleep(0.05)
    return False


def _wait_state(pid: int, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = proc_state(pid)
        if st is not None and st.state == state:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never reached state {state}: {proc_state(pid)}")


def test_a_stopped_rank_is_sigkilled_and_the_kill_published(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    rank, reaper_pid = _start_rank(d, "stop")
    try:
        _wait_state(rank.pid, "T")
        assert proc_state(reaper_pid).state in "RS"  # a stopped parent's child runs on
        _decision(d, 0, stuck=[1], missing=[1])
        (d / RECORDED).write_text("{}")
        assert rank.wait(timeout=30) == -signal.SIGKILL
        assert _wait_gone(reaper_pid), "the reaper outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    got = json.loads(reaped_path(d, 1).read_text())
    assert got["pid"] == rank.pid and got["rank"] == 1 and got["node"] == "node-1"
    assert got["proc_state"] == "T" and got["proc_state_name"] == "stopped"
    assert got["signal"] == "SIGKILL" and got["reason"] == "stopped" and got["attempt"] == 0
    assert sorted(p.name for p in d.iterdir()) == [  # the note: it cannot answer itself
        "decision-0.json", "reaped-rank-1.json", "recorded.json", "stopped-rank-1.json"]  # fmt: skip
    assert "[reaper] rank 1 on node-1" in rank.stderr.read()


def test_sigterm_to_a_stopped_ranks_group_kills_it_at_once(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    rank, reaper_pid = _start_rank(d, "stop")
    try:
        _wait_state(rank.pid, "T")
        _wait_sigterm_caught(reaper_pid)
        # torchrun's stop: SIGTERM to the worker's process group. No hang decided yet.
        os.killpg(rank.pid, signal.SIGTERM)
        assert rank.wait(timeout=30) == -signal.SIGKILL
        assert _wait_gone(reaper_pid)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    got = json.loads(reaped_path(d, 1).read_text())
    assert got["reason"] == "stopped at SIGTERM" and got["proc_state"] == "T"


def test_the_reaper_exits_with_its_rank_and_kills_nothing_then(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    rank, reaper_pid = _start_rank(d, "exit", linger=0.5)
    assert rank.wait(timeout=30) == 0  # a normal end: the reaper must follow it
    assert _wait_gone(reaper_pid), "the reaper outlived its rank"
    assert not d.exists()


def test_a_forged_decision_never_kills_a_healthy_rank(tmp_path) -> None:
    """A real rank with its real reaper (backstop 1 s), healthy and silent (no verdict of
    its own: it never hung); a forged decision naming it stuck and rank 0's record are
    dropped into its hang directory. It lives on past the backstop and exits by itself."""
    d = hang_dir(tmp_path, 0)
    rank, reaper_pid = _start_rank(d, "exit", linger=4.0, backstop=1.0)
    try:
        with open(f"/proc/{reaper_pid}/cmdline", "rb") as f:
            assert NONCE.encode() not in f.read()  # the nonce is not public in /proc
        _forge(d, DECISION.format(rank=0), nonce=None)
        (d / RECORDED).write_text("{}")
        assert rank.wait(timeout=60) == 0  # not -SIGKILL: it ended its own sleep
        assert _wait_gone(reaper_pid), "the reaper outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert not reaped_path(d, 1).exists()
    err = rank.stderr.read()
    assert "[reaper] rank 1:" in err and "decision-0.json refused" in err, err


def test_only_the_parent_with_its_start_time_is_ever_killed(tmp_path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st = proc_state(other.pid)
        r = _reaper(hang_dir(tmp_path, 0), parent=other.pid, parent_start=st.start)
        assert r._kill_parent(other.pid, st.start) is False  # not our parent
        start = proc_state(os.getppid()).start + 1
        assert r._kill_parent(os.getppid(), start) is False  # our parent, another start
        assert other.poll() is None
        # A parent that is not ours any more (it exited): the reaper is done, kills nothing.
        assert r.parent_alive() is False and r.tick() is True
    finally:
        other.kill()
        other.wait()
