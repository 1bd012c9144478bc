"""Hang watchdog: the detection-time policy, the verdict logic, the in-process hang path
through a real GoodputMeter, recovery of a record rank 0 could not write, the goodput
booking of a hang and the hang fault. No assertion depends on how fast this machine is:
deadlines are checked at explicit clock values, and waits only bound a failure."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.hangs import (
    DECISION,
    HANGS_DIR,
    RECORDED,
    classify_stack,
    decide,
    hang_dir,
    read_verdicts,
)
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.records import Rejects
from steadytrain.monitor.watchdog import (
    HANG_EXIT_CODE,
    HangWatchdog,
    WatchdogConfig,
    backend_timeout_s,
    p99,
    recover_hang_records,
)
from steadytrain.settings import InvalidSetting
from steadytrain.testing import forkserver


# -- detection-time policy ---------------------------------------------------------------
def test_deadline_is_k_p99_with_a_floor_and_long_phases_have_their_own() -> None:
    cfg = WatchdogConfig(k=5, floor_s=60, init_s=300, checkpoint_s=480)
    assert cfg.deadline("step", None) == 60  # no step time yet: the floor
    assert cfg.deadline("step", 2.0) == 60  # 5 x 2 s is below the floor
    assert cfg.deadline("step", 30.0) == 150  # slow steps: k x p99
    assert cfg.deadline("init", 2.0) == 300
    assert cfg.deadline("checkpoint", 2.0) == 480
    assert cfg.deadline("checkpoint", 200.0) == 1000  # a step slower than the save budget
    defaults = WatchdogConfig()
    # The anchors: a 60 s floor, and every deadline below NCCL's 10 min (gloo: 30 min).
    assert defaults.floor_s == 60 and defaults.longest_static_s + 2 * defaults.grace_s < 600


@pytest.mark.parametrize(
    ("key", "value"),
    [("k", 0.5), ("floor_s", 0), ("poll_s", 40.0), ("warmup_steps", 0), ("window", 3)],
)
def test_bad_settings_name_the_key(key: str, value: float) -> None:
    with pytest.raises(InvalidSetting, match=rf"^{key} = "):
        WatchdogConfig(**{key: value})


def test_p99_is_the_nearest_rank() -> None:
    assert p99([]) is None
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([1.0] * 9 + [7.0]) == 7.0  # few samples: the worst one


def test_backend_timeouts_are_torchs_defaults() -> None:
    assert backend_timeout_s("gloo") == 1800.0
    assert backend_timeout_s("nccl") == 600.0
    assert backend_timeout_s("cpu:gloo,cuda:nccl") == 600.0


def test_check_uses_the_phase_deadline_and_skips_phase_steps() -> None:
    cfg = WatchdogConfig(enabled=False, floor_s=10, init_s=100, checkpoint_s=50, warmup_steps=2)
    wd = HangWatchdog("unused", config=cfg)
    now = time.monotonic
    assert wd.check(now() + 99) is None  # no step yet: init_s
    assert wd.check(now() + 101)["phase"] == "init"
    wd.beat(1)
    wd.beat(2)
    assert len(wd._intervals) == 1  # the first beat has no interval
    assert wd.check(now() + 9) is None
    seen = wd.check(now() + 11)
    assert seen["phase"] == "step" and seen["step"] == 2 and seen["deadline_s"] == 10
    with wd.phase("checkpoint"):
        assert wd.check(now() + 49) is None
        assert wd.check(now() + 51)["phase"] == "checkpoint"
    wd.beat(3)  # this interval spans the save: not a step time sample
    assert len(wd._intervals) == 1
    wd.beat(4)
    assert len(wd._intervals) == 2


# -- where a rank stands, and who is to blame --------------------------------------------
LOOP = ("/x/steadytrain/train/loop.py", 300, "run_training")
C10D = ("/x/torch/distributed/distributed_c10d.py", 2800, "all_reduce")
LOGGER = ("/x/torch/distributed/c10d_logger.py", 80, "wrapper")


def test_classify_stack() -> None:
    assert classify_stack([C10D, LOGGER, LOOP]) == (
        "waiting",
        "/x/torch/distributed/distributed_c10d.py:2800 all_reduce",
        "all_reduce",
    )
    backward = ("/x/torch/autograd/graph.py", 820, "_engine_run_backward")
    assert classify_stack([backward, ("/x/torch/_tensor.py", 600, "backward"), LOOP])[0::2] == (
        "waiting",
        "backward",
    )
    hang = ("/x/steadytrain/train/faults.py", 170, "_hang")
    assert classify_stack([hang, LOOP]) == (
        "stuck",
        "/x/steadytrain/train/faults.py:170 _hang",
        None,
    )
    ckpt_io = ("/x/torch/distributed/checkpoint/filesystem.py", 400, "_write_files")
    assert classify_stack([ckpt_io, LOOP])[0] == "stuck"  # file I/O is not a collective
    assert classify_stack([]) == ("stuck", None, None)


def _v(rank: int, state: str, step: int = 9) -> dict:
    return {"rank": rank, "node": f"n{rank}", "frame": f"f{rank}", "state": state, "step": step}


def test_decide_names_the_rank_not_in_a_collective() -> None:
    got = decide({0: _v(0, "waiting"), 1: _v(1, "stuck"), 2: _v(2, "waiting")}, 3)
    assert got["stuck_ranks"] == [1] and got["cause"] == "not in a collective"
    assert got["stuck"] == [
        {"rank": 1, "node": "n1", "frame": "f1", "state": "stuck", "step": 9, "stack": []}
    ]


def test_decide_names_a_silent_rank() -> None:
    got = decide({0: _v(0, "waiting")}, 2)  # rank 1 SIGSTOPped: no verdict
    assert got["stuck_ranks"] == [1] and got["missing_ranks"] == [1]
    assert got["stuck"][0]["state"] == "no_response" and got["cause"] == "no response"


def test_decide_when_every_rank_waits() -> None:
    behind = decide({0: _v(0, "waiting", 9), 1: _v(1, "waiting", 8)}, 2)
    assert behind["stuck_ranks"] == [1] and "desync" in behind["cause"]
    same = decide({0: _v(0, "waiting"), 1: _v(1, "waiting")}, 2)
    assert same["stuck_ranks"] == [0, 1] and "collective" in same["cause"]


def test_verdicts_that_are_not_of_this_jobs_ranks_are_skipped(tmp_path) -> None:
    """A verdict for a rank the job never had, another run's, or one filed under another
    rank's name is no rank's answer: skipped and counted; ``decide`` never names a rank
    outside the world, and the next attempt's recovered record neither."""
    run = tmp_path / "run"
    d = hang_dir(run, 0)
    d.mkdir(parents=True)
    nonce = "12" * 16
    base = {"world_size": 2, "detect_t": 100.0, "progress_t": 90.0, "since_progress_s": 10.0,
            "deadline_s": 5.0, "phase": "step", "nonce": nonce}  # fmt: skip
    (d / "rank-0.json").write_text(json.dumps({**_v(0, "waiting"), **base}))
    (d / "rank-7.json").write_text(json.dumps({**_v(7, "stuck"), **base, "world_size": 8}))
    (d / "rank-1.json").write_text(json.dumps({**_v(1, "waiting"), **base, "nonce": "x"}))
    (d / "rank-3.json").write_text(json.dumps({**_v(0, "stuck"), **base}))  # rank 0's?
    rej = Rejects()
    got = read_verdicts(d, rej, nonce=nonce, world_size=2)
    assert list(got) == [0] and rej.total == 3, rej.to_dict()
    # Without the checks a rank of another world is still no rank of this job's.
    assert decide({0: _v(0, "waiting"), 7: _v(7, "stuck")}, 2)["stuck_ranks"] == [1]
    meter = GoodputMeter(run)
    meter.job_start()
    assert recover_hang_records(run, meter, nonce=nonce) == 1
    meter.close()
    [h] = [r for r in read_ledger(run / "ledger.jsonl") if r["type"] == "hang"]
    assert h["stuck_ranks"] == [1] and h["missing_ranks"] == [1] and h["world_size"] == 2


# -- the hang path, in process: dumps, verdict, ledger record, exit ----------------------
def test_a_hang_dumps_records_through_the_meter_and_exits(tmp_path) -> None:
    run = tmp_path / "run"
    d = hang_dir(run, 3)
    d.mkdir(parents=True)
    other = {**_v(1, "waiting"), "world_size": 2, "detect_t": time.time(),
             "progress_t": time.time() - 1, "since_progress_s": 1.0, "deadline_s": 0.2}  # fmt: skip
    (d / "rank-1.json").write_text(json.dumps(other))  # rank 1 answered: it waits for us
    meter = GoodputMeter(run, rank=0, world_size=2)
    meter.job_start()
    exited: list[int] = []
    done = threading.Event()
    cfg = WatchdogConfig(floor_s=0.2, poll_s=0.05, warmup_steps=1, init_s=0.2, grace_s=5,
                         reaper=False)  # fmt: skip
    wd = HangWatchdog(run, 0, 2, attempt=3, meter=meter, config=cfg,
                      exit=lambda code: (exited.append(code), done.set()))  # fmt: skip
    wd.beat(1)
    assert done.wait(30), "the watchdog never fired"  # this thread is the stuck loop
    wd.close()
    meter.close()
    assert exited == [HANG_EXIT_CODE]
    # Innermost is threading's wait; the stack shows where the loop (this test) waits.
    assert wd.fired["state"] == "stuck" and wd.fired["frame"].endswith(" wait")
    assert any("test_monitor_watchdog.py" in f for f in wd.fired["stack"])
    dump = (d / "rank-0.txt").read_text()
    assert "test_a_hang_dumps_records_through_the_meter_and_exits" in dump
    hang = [r for r in read_ledger(run / "ledger.jsonl") if r["type"] == "hang"]
    assert len(hang) == 1 and hang[0]["stuck_ranks"] == [0] and hang[0]["attempt"] == 3
    assert hang[0]["stuck"][0]["stack"] == wd.fired["stack"]
    assert hang[0]["step"] == 1 and hang[0]["recovered"] is False
    assert json.loads((d / RECORDED).read_text())["stuck_ranks"] == [0]
    decision = json.loads((d / DECISION.format(rank=0)).read_text())  # for the reapers
    assert decision["stuck_ranks"] == [0] and decision["missing_ranks"] == []
    assert decision["attempt"] == 3 and decision["rank"] == 0
    again = GoodputMeter(run)
    assert recover_hang_records(run, again) == 0  # recorded already
    again.close()


def test_a_rank_does_not_wait_for_the_record_of_a_silent_rank_0(tmp_path) -> None:
    run = tmp_path / "run"
    d = hang_dir(run, 0)
    exited: list[float] = []
    done = threading.Event()
    grace = 4.0
    cfg = WatchdogConfig(floor_s=0.2, poll_s=0.05, warmup_steps=1, init_s=0.2, grace_s=grace,
                         reaper=False)  # fmt: skip
    wd = HangWatchdog(run, 1, 2, config=cfg,
                      exit=lambda code: (exited.append(time.time()), done.set()))  # fmt: skip
    wd.beat(1)
    assert done.wait(60), "the watchdog never fired"
    wd.close()
    decision = json.loads((d / DECISION.format(rank=1)).read_text())
    assert decision["missing_ranks"] == [0] and decision["stuck_ranks"] == [0, 1]  # we: stuck
    assert not (d / RECORDED).exists()  # rank 0 (SIGSTOPped) writes none
    # The verdict wait (grace) only: waiting 2 x grace more for rank 0's record, which
    # cannot come, would end at 3 x grace at the earliest.
    assert exited[0] - wd.fired["detect_t"] < 3 * grace


def _exec_argv(pid: int, marker: str, timeout_s: float = 30.0) -> list[str]:
    """A child's argv once it has exec'd: until then /proc shows the forking parent's
    command line, or nothing while the exec is under way (an empty read under CI's load)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        if marker in argv or time.monotonic() > deadline:
            return argv
        time.sleep(0.02)


def test_a_reaper_runs_beside_the_watchdog_of_a_rank_and_ends_with_it(tmp_path) -> None:
    cfg = WatchdogConfig(floor_s=60, poll_s=0.5)
    alone = HangWatchdog(tmp_path, 0, 1, config=cfg)  # one rank: nobody decides a hang
    assert alone.reaper is None
    alone.close()
    off = HangWatchdog(tmp_path, 0, 2, config=WatchdogConfig(floor_s=60, reaper=False))
    assert off.reaper is None
    off.close()
    nonce = "7f" * 16
    wd = HangWatchdog(tmp_path, 1, 2, attempt=2, config=cfg, nonce=nonce)
    proc = wd.reaper
    try:
        assert proc is not None and proc.poll() is None
        argv = _exec_argv(proc.pid, "--rank=1")
        assert argv[3].endswith("reaper.py") and f"--parent={os.getpid()}" in argv
        assert f"--dir={hang_dir(tmp_path, 2)}" in argv and "--rank=1" in argv
        assert "--world=2" in argv and not any(nonce in a for a in argv)  # public in /proc
        with open(f"/proc/{proc.pid}/environ", "rb") as f:  # readable by this user only
            assert f"STEADYTRAIN_REAPER_NONCE={nonce}".encode() in f.read().split(b"\0")
    finally:
        wd.close()
    assert proc.poll() is not None and wd.reaper is None  # killed and waited for


def test_next_attempt_records_a_hang_rank_0_could_not_once(tmp_path) -> None:
    run = tmp_path / "run"
    d = hang_dir(run, 1)
    d.mkdir(parents=True)
    v0 = {**_v(0, "waiting"), "world_size": 2, "detect_t": 100.0, "progress_t": 90.0,
          "since_progress_s": 10.0, "deadline_s": 8.0, "phase": "step"}  # fmt: skip
    (d / "rank-0.json").write_text(json.dumps(v0))  # rank 1 stopped: no verdict, no record
    (run / HANGS_DIR / "attempt-2").mkdir()  # an empty one: nothing to say
    for _ in range(2):  # two restarts: the record is written by the first only
        meter = GoodputMeter(run)
        meter.job_start()
        recover_hang_records(run, meter)
        meter.close()
    hangs = [r for r in read_ledger(run / "ledger.jsonl") if r["type"] == "hang"]
    assert len(hangs) == 1
    h = hangs[0]
    assert h["recovered"] is True and h["attempt"] == 1 and h["stuck_ranks"] == [1]
    assert h["cause"] == "no response" and h["frame"] is None and h["detect_s"] == 10.0
    other = GoodputMeter(run, rank=1)
    assert recover_hang_records(run, other) == 0  # only rank 0 writes the ledger
    other.close()


# -- goodput: detection time is restart_gap, not "other" ---------------------------------
def _step(t: float, step: int) -> dict:
    return {"type": "step", "t": t, "step": step, "tokens": 8, "step_s": 1.0,
            "data_wait_s": 0.0, "compute_s": 1.0, "checkpoint_block_s": 0.0}  # fmt: skip


def test_goodput_books_a_hang_from_its_last_step_to_the_restart() -> None:
    recs = [
        {"type": "job_start", "t": 10.0, "attempt": 0, "startup_s": 0.0},
        _step(11.0, 1),
        _step(12.0, 2),
        {"type": "hang", "t": 80.0, "attempt": 0, "step": 2, "recovered": False},
        {"type": "job_start", "t": 95.0, "attempt": 1, "startup_s": 5.0, "restored_step": 2},
        _step(96.0, 3),
    ]
    b = compute_goodput(recs)
    assert b.badput_s["restart_gap"] == 90.0 - 12.0  # process start 90 - last step 12
    assert b.attempt_summaries[0]["reason"] == "hang"
    assert b.attempt_summaries[0]["end_t"] == 12.0
    # The same hang recorded by the next attempt (recovered) names the same attempt.
    moved = recs[:3] + recs[4:5] + [{**recs[3], "recovered": True}] + recs[5:]
    b2 = compute_goodput(moved)
    assert b2.badput_s == b.badput_s and b2.attempt_summaries[0]["reason"] == "hang"


# -- the hang fault -----------------------------------------------------------------------
HANG_CHILD = """
import sys
from steadytrain.train.config import FaultConfig
from steadytrain.train.faults import FaultInjector
inj = FaultInjector(FaultConfig(hang_at_step=2, hang_rank=0, hang_mode="sigstop"), sys.argv[1], 0)
for step in range(1, 4):
    inj.mid_step(step)
    print(step, flush=True)
"""


def test_sigstop_hang_fault_stops_the_process_once_per_run(tmp_path) -> None:
    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-c", HANG_CHILD, str(tmp_path)]
    # Forked from the fork server: the fault's module imports torch, once per test process.
    proc = forkserver.popen(cmd, merge=False)
    try:
        marker = tmp_path / "faults" / "hang-2.fired"
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            status = psutil.Process(proc.pid).status()
            if marker.exists() and status == psutil.STATUS_STOPPED:
                break
            time.sleep(0.05)
        assert status == psutil.STATUS_STOPPED, status
    finally:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
    assert out.split() == ["1"] and "hangs in step 2" in err
    again = forkserver.run(cmd, timeout=60)  # restarted
    assert again.returncode == 0 and again.stdout.split() == ["1", "2", "3"]
    assert os.path.exists(marker)
