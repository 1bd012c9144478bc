"""Declared phases of the hang watchdog (issue 40, "never kill a healthy rank"): phases nest
and leaving one restores the one around it; each name has its own deadline, configurable
and checked; a phase one rank declares holds every other rank of the job (two watchdogs of
one "job" in this process, sharing a run directory); foreign records hold nobody.

Deadlines are checked at explicit clock values (``check``/``poll`` take ``now``); where a
real interval is needed (a phase older than a poll, a deadline that passed in real time)
the test sleeps for it, and waits only bound a failure."""

from __future__ import annotations

import json
import os
import threading
import time
import tomllib

import pytest

from steadytrain.integrations.hooks import TrainerSaves
from steadytrain.monitor.hangs import DECISION, decide, hang_dir, hang_record, read_verdicts
from steadytrain.monitor.phases import job_cover, phase_dir
from steadytrain.monitor.watchdog import HANG_EXIT_CODE, HangWatchdog, WatchdogConfig
from steadytrain.run import Run
from steadytrain.settings import InvalidSetting, read_toml
from steadytrain.train.config import (
    apply_overrides,
    config_from_dict,
    load_config,
    resolve_config_path,
)

NONCE = "ab" * 16


def _cfg(**kw) -> WatchdogConfig:
    base = dict(enabled=False, floor_s=10, init_s=100, checkpoint_s=50, warmup_steps=1,
                phases={"eval_s": 200}, reaper=False)  # fmt: skip
    return WatchdogConfig(**{**base, **kw})


# -- nesting ------------------------------------------------------------------------------
def test_phases_nest_and_leaving_one_restores_the_outer_one() -> None:
    wd = HangWatchdog("unused", config=_cfg())
    wd.beat(1)
    with wd.phase("checkpoint"):
        with wd.phase("eval"):  # the longest open deadline is in force: eval's 200 s
            t = time.monotonic()
            assert wd.check(t + 199) is None
            got = wd.check(t + 201)
            assert got["phase"] == "eval" and got["phases"] == ["checkpoint", "eval"]
        t = time.monotonic()  # leaving eval was progress; checkpoint is in force again
        assert wd.check(t + 49) is None
        assert wd.check(t + 51)["phase"] == "checkpoint"
    t = time.monotonic()
    assert wd.check(t + 9) is None and wd.check(t + 11)["phase"] == "step"


def test_a_phase_left_out_of_order_leaves_the_other_in_force() -> None:
    """A trainer callback opens and closes phases in separate hooks: an eval phase that
    ends after the save phase it overlapped must not take the save's phase with it."""
    wd = HangWatchdog("unused", config=_cfg())
    wd.beat(1)
    ev, ck = wd.phase("eval"), wd.phase("checkpoint")
    ev.__enter__()
    ck.__enter__()
    ev.__exit__(None, None, None)
    t = time.monotonic()
    assert wd.check(t + 49) is None and wd.check(t + 51)["phases"] == ["checkpoint"]
    ck.__exit__(None, None, None)
    assert wd.check(time.monotonic() + 11)["phase"] == "step"


def test_step_done_inside_a_phase_leaves_that_phase_guarded(tmp_path) -> None:
    """``with run.phase(...): ... run.step_done(...)``: step_done's own checkpoint phase
    used to end by setting no phase at all, so the rest of the outer phase ran under the
    step deadline."""
    monitor = {"watchdog": {"enabled": False, "floor_s": 10, "checkpoint_s": 50,
                            "warmup_steps": 1, "phases": {"eval_s": 200}},
               "sinks": ["jsonl"]}  # fmt: skip
    with Run(tmp_path / "run", {}, checkpoint=TrainerSaves(), monitor=monitor) as run:
        with run.phase("eval"):
            run.step_done(1)  # enters and leaves its own "checkpoint" phase
            t = time.monotonic()
            assert run.watchdog.check(t + 199) is None  # still eval's deadline
            assert run.watchdog.check(t + 201)["phase"] == "eval"


# -- deadlines per name, and their settings ------------------------------------------------
def test_each_phase_name_has_its_own_deadline_and_unknown_names_get_the_checkpoints() -> None:
    cfg = WatchdogConfig(floor_s=60, checkpoint_s=480, init_s=300, phases={"eval_s": 900})
    assert cfg.deadline("eval", None) == 900
    assert cfg.deadline("checkpoint", None) == 480
    assert cfg.deadline("export", None) == 480  # the user's own name: never the step's 60
    assert cfg.deadline("eval", 200.0) == 8 * 200  # a step slower than the phase budget
    assert cfg.deadline("step", None) == 60 and cfg.deadline("init", None) == 300
    assert WatchdogConfig().deadline("eval", None) == WatchdogConfig().checkpoint_s
    assert cfg.longest_static_s == 900  # what the backend-timeout warning compares


def test_a_phase_never_shortens_the_deadline_it_is_entered_under() -> None:
    wd = HangWatchdog("unused", config=_cfg(init_s=100, warmup_steps=5, phases={"eval_s": 20}))
    with wd.phase("eval"):  # in warm-up: init's 100 s stays in force over eval's 20
        t = time.monotonic()
        assert wd.check(t + 99) is None and wd.check(t + 101)["phase"] == "init"


@pytest.mark.parametrize(
    ("phases", "key"),
    [
        ({"eval": 5}, "phases.eval"),  # no _s suffix
        ({"eval_s": 0}, "phases.eval_s"),
        ({"eval_s": -3}, "phases.eval_s"),
        ({"eval_s": float("nan")}, "phases.eval_s"),
        ({"eval_s": True}, "phases.eval_s"),
        ({"eval_s": "900"}, "phases.eval_s"),
        ({"checkpoint_s": 900}, "phases.checkpoint_s"),  # one key per deadline
        ({"step_s": 5}, "phases.step_s"),  # the watchdog's own names
        ({"init_s": 5}, "phases.init_s"),
        ({"my-eval_s": 5}, "phases.my-eval_s"),  # not a name phase() accepts
    ],
)
def test_bad_phase_deadlines_are_refused_naming_the_key(phases: dict, key: str) -> None:
    with pytest.raises(InvalidSetting) as e:
        WatchdogConfig(phases=phases)
    assert e.value.key == key, e.value


def test_phase_deadlines_from_toml_and_set(tmp_path) -> None:
    raw = read_toml(resolve_config_path("demo"))  # + a [monitor.watchdog.phases] table
    table = tomllib.loads("[monitor.watchdog.phases]\neval_s = 900\n")["monitor"]["watchdog"]
    raw.setdefault("monitor", {}).setdefault("watchdog", {}).update(table)
    sets = ["data.dataset=ds", "monitor.watchdog.phases.export_s=30"]
    cfg = config_from_dict(apply_overrides(raw, sets))
    assert cfg.monitor.watchdog.phases == {"eval_s": 900.0, "export_s": 30.0}
    bad = ["data.dataset=ds", "monitor.watchdog.phases.checkpoint_s=30"]
    with pytest.raises(InvalidSetting, match=r"^monitor\.watchdog\.phases\.checkpoint_s = "):
        load_config("demo", bad)


@pytest.mark.parametrize("name", ["step", "init", "my eval", "", 3])
def test_a_phase_name_that_cannot_be_configured_is_refused(name) -> None:
    wd = HangWatchdog("unused", config=_cfg())
    with pytest.raises(ValueError, match="phases.<name>_s"):
        wd.phase(name)
    with wd.phase("export"):  # any identifier is fine
        pass


# -- the job-wide rule: two ranks of one job in this process -------------------------------
def _pair(run, **kw) -> tuple[HangWatchdog, HangWatchdog]:
    cfg = _cfg(floor_s=1, poll_s=0.1, phases={"eval_s": 30}, **kw)
    return (
        HangWatchdog(run, 0, 2, config=cfg, nonce=NONCE),
        HangWatchdog(run, 1, 2, config=cfg, nonce=NONCE),
    )


def test_a_phase_shorter_than_a_poll_is_never_published(tmp_path) -> None:
    w0, _ = _pair(tmp_path)
    w0.beat(1)
    with w0.phase("checkpoint"):  # step_done's, every step: no I/O on the loop thread
        assert w0.poll(time.monotonic() + 0.05) is None
    assert w0.poll() is None
    assert not phase_dir(tmp_path, 0).exists()


def test_a_rank_inside_a_declared_phase_holds_the_others(tmp_path) -> None:
    w0, w1 = _pair(tmp_path)
    w0.beat(1)
    w1.beat(1)
    with w0.phase("eval"):
        time.sleep(0.15)  # in eval for longer than a poll
        assert w0.poll() is None  # rank 0 publishes its phase
        rec = json.loads((phase_dir(tmp_path, 0) / "phase-rank-0.json").read_text())
        assert rec["state"] == "open" and rec["phase"] == "eval" and rec["deadline_s"] == 30
        assert rec["nonce"] == NONCE and rec["attempt"] == 0
        t = time.monotonic()
        # Rank 1's own step deadline (1 s) has passed; rank 0's eval deadline has not.
        assert w1.check(t + 5) is not None
        assert w1.poll(t + 5) is None
        assert w1.poll(t + 25) is None
        until = rec["progress_t"] + 30
        # A hang inside the declared phase is still found, at that phase's deadline.
        late = t + (until - time.time()) + 0.5
        seen = w1.poll(late)
        assert seen is not None and seen["phase"] == "step"
    held = w1._board.held_by(w1._t)
    assert held["rank"] == 0 and held["phase"] == "eval" and held["until_t"] == until


def test_a_phase_left_is_progress_of_the_whole_job(tmp_path) -> None:
    """Rank 1 waited through rank 0's phase; in the instant between the phase's end and
    the next collective it must not fire: its deadline counts from the phase's end."""
    w0, w1 = _pair(tmp_path)
    w0.beat(1)
    w1.beat(1)
    with w0.phase("eval"):
        time.sleep(0.15)
        w0.poll()
        time.sleep(1.1)  # rank 1's own deadline (1 s) passes inside rank 0's eval
        assert w1.check() is not None and w1.poll() is None
    left = time.monotonic()
    w0.poll()  # rank 0's watchdog sees the phase ended and says so
    rec = json.loads((phase_dir(tmp_path, 0) / "phase-rank-0.json").read_text())
    assert rec["state"] == "closed" and rec["closed_t"] > rec["entered_t"]
    assert w1.poll(left + 0.8) is None  # within 1 s of the phase's end: held
    assert w1.poll(left + 1.3) is not None  # past it: rank 0 went nowhere after it


def test_records_that_are_not_this_jobs_hold_nobody(tmp_path) -> None:
    _, w1 = _pair(tmp_path)
    w1.beat(1)
    d = phase_dir(tmp_path, 0)
    d.mkdir(parents=True)
    good = {"rank": 0, "attempt": 0, "nonce": NONCE, "phase": "eval", "state": "open",
            "progress_t": time.time(), "deadline_s": 1000.0}  # fmt: skip
    (d / "phase-rank-0.json").write_text(json.dumps({**good, "nonce": "cd" * 16}))
    (d / "phase-rank-3.json").write_text(json.dumps({**good, "rank": 3}))  # not of the job
    (d / "phase-rank-2.json").write_text(json.dumps({**good, "rank": 0}))  # rank 0's?
    os.mkfifo(d / "phase-rank-4.json")
    (d / "phase-rank-5.json").write_text("[" * 100_000)
    t = time.monotonic()
    assert w1.poll(t + 2) is not None  # nothing holds it: its own deadline fires
    assert w1._board.rejects.total == 5, w1._board.rejects.to_dict()
    # The same record with this run's nonce holds it, capped at its own longest deadline.
    (d / "phase-rank-0.json").write_text(json.dumps(good))
    assert w1.poll(t + 2) is None
    assert w1._board.held_by(w1._t)["until_t"] == pytest.approx(
        good["progress_t"] + w1.config.longest_static_s
    )


def test_job_cover_takes_the_phase_that_holds_longest() -> None:
    now = 1000.0
    recs = [
        {"rank": 1, "phase": "eval", "state": "open", "progress_t": 990.0, "deadline_s": 30.0},
        {"rank": 2, "phase": "checkpoint", "state": "open", "progress_t": 900.0,
         "deadline_s": 50.0},  # expired at 950
        {"rank": 3, "phase": "eval", "state": "closed", "progress_t": 990.0, "deadline_s": 30.0,
         "closed_t": 999.0},
    ]  # fmt: skip
    c = job_cover(recs, now, limit_s=5.0)
    assert (c.rank, c.until_t, c.closed_t) == (1, 1020.0, None)
    c = job_cover(recs[1:], now, limit_s=5.0)
    assert (c.rank, c.until_t, c.closed_t) == (3, 1004.0, 999.0)
    assert job_cover(recs[1:2], now, 5.0) is None
    future = [{**recs[0], "progress_t": 5000.0}]  # claims the future: counts as now
    assert job_cover(future, now, 5.0).until_t == 1030.0


def test_the_hang_is_recorded_at_the_declared_phases_deadline(tmp_path) -> None:
    """Rank 1's real watchdog thread, held by rank 0 inside "eval" (rank 0 never leaves it,
    as a rank SIGSTOPped inside it): it fires once eval's deadline passed, its verdict says
    which phase held it, and its decision carries the run's nonce for the reapers."""
    cfg = WatchdogConfig(floor_s=0.4, poll_s=0.1, warmup_steps=1, grace_s=0.5,
                         phases={"eval_s": 2.0}, reaper=False)  # fmt: skip
    w0 = HangWatchdog(tmp_path, 0, 2, config=WatchdogConfig(**{**vars(cfg), "enabled": False}),
                      nonce=NONCE)  # fmt: skip
    done = threading.Event()
    w0.beat(1)
    ev = w0.phase("eval")
    ev.__enter__()
    time.sleep(0.15)
    w0.poll()  # published: rank 0 is inside eval
    w1 = HangWatchdog(tmp_path, 1, 2, config=cfg, nonce=NONCE, exit=lambda c: done.set())
    w1.beat(1)
    beat_t = time.time()  # rank 1's progress was no later than this
    try:
        assert done.wait(60), "rank 1's watchdog never fired"
    finally:
        w1.close()
    v = w1.fired
    held = v["held_by"]
    assert held["rank"] == 0 and held["phase"] == "eval" and held["deadline_s"] == 2.0
    assert v["detect_t"] >= held["until_t"]  # not before the eval deadline
    # It waited out eval's deadline, not its own 0.4 s floor: from rank 1's beat to at least
    # eval's end (a fixed 2.0 - 0.15 s failed at load 9: 1.848 s, rank 1 set up 2 ms late).
    assert v["deadline_s"] == 0.4 and v["since_progress_s"] >= held["until_t"] - beat_t - 0.005
    assert held["until_t"] - beat_t > 0.5  # so the bound above is above the 0.4 s floor
    d = hang_dir(tmp_path, 0)
    decision = json.loads((d / DECISION.format(rank=1)).read_text())
    assert decision["nonce"] == NONCE and decision["missing_ranks"] == [0]
    rec = hang_record(0, read_verdicts(d), decide(read_verdicts(d), 2), 2, recovered=False,
                      kill_t=None)  # fmt: skip
    assert (rec["phase"], rec["deadline_s"], rec["phase_rank"]) == ("eval", 2.0, 0)
    assert rec["progress_t"] == held["progress_t"]  # rank 0's, whose phase held rank 1
    ev.__exit__(None, None, None)
    w0.close()
    assert HANG_EXIT_CODE == 124
