"""The hang watchdog and the reaper beside in-place recovery (issue 44 section 2): a
stopped rank's reaper answers for it (``stopped-rank-{R}.json``), so the answering ranks
decide without waiting out their grace, and a rank the decision does not name does not
exit while in-place recovery replaces the named one. The whole chain under torchrun is in
tests/integrations/test_inplace.py (a SIGSTOPped rank). Waits only bound a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from steadytrain.monitor.hangs import hang_dir, read_stopped
from steadytrain.monitor.reaper import STOPPED_NOTE, Reaper, proc_state
from steadytrain.monitor.watchdog import HangWatchdog, WatchdogConfig

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

NONCE = "5e" * 16


def _wait_for(pred, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def stopped_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for(lambda: proc_state(child.pid).state == "T", "the child stopped")
    yield child
    child.kill()
    child.wait()


def _reaper(d, pid: int, rank: int = 1) -> Reaper:
    return Reaper(d, rank=rank, node="n", attempt=0, world_size=2, nonce=NONCE, parent=pid,
                  parent_start=proc_state(pid).start, since=time.time(),
                  kill=lambda *_: False, getppid=lambda: pid)  # fmt: skip


def test_a_stopped_rank_is_noted_once_a_hang_is_being_decided(tmp_path, stopped_child) -> None:
    d = hang_dir(tmp_path, 0)
    r = _reaper(d, stopped_child.pid)
    r.tick()
    assert not d.exists() and read_stopped(d, nonce=NONCE, world_size=2) == set()
    d.mkdir(parents=True)  # a rank fired: its verdict is on the way
    r.tick()
    note = json.loads((d / STOPPED_NOTE.format(rank=1)).read_text())
    assert note["pid"] == stopped_child.pid and note["proc_state"] == "T"
    assert read_stopped(d, nonce=NONCE, world_size=2) == {1}
    assert read_stopped(d, nonce="another run", world_size=2) == set()


def test_a_running_rank_is_not_noted(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    d.mkdir(parents=True)
    _reaper(d, os.getpid()).tick()  # this process runs: it can answer for itself
    assert list(d.iterdir()) == []


def test_a_note_that_is_not_this_jobs_is_skipped(tmp_path) -> None:
    d = hang_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "stopped-rank-0.json").write_text(json.dumps({"rank": 1, "nonce": NONCE}))  # misnamed
    (d / "stopped-rank-5.json").write_text(json.dumps({"rank": 5, "nonce": NONCE}))  # no rank
    (d / "stopped-rank-1.json").write_text("not json")
    assert read_stopped(d, nonce=NONCE, world_size=2) == set()


def _seen() -> dict:
    return {"step": 3, "phase": "step", "phases": [], "since_progress_s": 9.0,
            "deadline_s": 5.0, "p99_step_s": 0.1}  # fmt: skip


def test_the_others_decide_at_once_on_a_stopped_ranks_note(tmp_path) -> None:
    """Grace 600 s: without the note, the decision would wait 10 minutes for rank 1."""
    d = hang_dir(tmp_path, 0)
    d.mkdir(parents=True)
    note = {"rank": 1, "pid": 1, "proc_state": "T", "t": time.time(), "nonce": NONCE}
    (d / STOPPED_NOTE.format(rank=1)).write_text(json.dumps(note))
    cfg = WatchdogConfig(floor_s=60, grace_s=600, reaper=False)
    wd = HangWatchdog(tmp_path, 0, 2, config=cfg, nonce=NONCE, exit=lambda _c: None)
    got: list[dict] = []
    t = threading.Thread(target=lambda: got.append(wd._report(_seen())), daemon=True)
    t.start()
    t.join(120)
    wd.close()
    assert got, "the decision waited for a verdict a stopped rank cannot send"
    assert 1 in got[0]["stuck_ranks"] and got[0]["missing_ranks"] == [1]


@pytest.mark.parametrize(
    "in_place,stuck,spared",
    [(True, [1], True), (True, [0, 1], False), (False, [1], False)],
    ids=["named-other", "named-self", "off"],
)
def test_only_an_unnamed_rank_with_in_place_on_is_spared(
    tmp_path, in_place: bool, stuck: list[int], spared: bool
) -> None:
    cfg = WatchdogConfig(floor_s=60, reaper=False)
    wd = HangWatchdog(tmp_path, 0, 2, config=cfg, in_place=in_place, exit=lambda _c: None)
    decision = {"stuck_ranks": stuck, "missing_ranks": [1], "cause": "no response"}
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(wd._spare(decision)), daemon=True)
    t.start()
    if spared:  # it waits for the loop's regroup: close() is what ends the wait
        _wait_for(lambda: wd.spared is not None, "the rank was spared")
        assert t.is_alive() and not result
    wd.close()
    t.join(60)
    assert result == [spared] and (wd.spared is not None) == spared


def test_a_spared_rank_that_is_never_closed_is_not_spared_for_long(tmp_path) -> None:
    """The regroup never came (the culprit outlived its reaper, the collective never
    raised): after ``hold_s`` the rank is not spared any more, and ``_handle`` exits it
    (torchrun's whole restart takes over)."""
    wd = HangWatchdog(tmp_path, 0, 2, config=WatchdogConfig(floor_s=60, reaper=False),
                      in_place=True, exit=lambda _c: None)  # fmt: skip
    wd.hold_s = 0.5
    decision = {"stuck_ranks": [1], "missing_ranks": [1], "cause": "no response"}
    assert wd._spare(decision) is False and wd.spared == decision
    wd.close()
