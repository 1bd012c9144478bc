"""Failure incidents from a run's own records (``diagnose/failures.py``).

Each test writes a small run directory through the product's own writers -- rank 0's
``Ledger``, every rank's ``RankFile``, the watchdog's verdict files -- shaped like what a
real job writes (the node harness's node-loss and hang replays), and asserts on
``detect(load(run_dir))``: the kind, the node and rank, the step, what it cost, and that no
IP address ever reaches an incident.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from steadytrain.diagnose.failures import detect
from steadytrain.diagnose.failures_attempts import Words
from steadytrain.diagnose.inputs import load
from steadytrain.diagnose.job_state import job_state
from steadytrain.monitor.hangs import hang_dir
from steadytrain.monitor.ledger import Ledger
from steadytrain.monitor.rank_recorder import RankRecorder
from steadytrain.monitor.ranks import RankFile, host_addrs

T0 = 1_800_000_000.0
STEP_S = 0.5
ADDRS = {"node-0": ["10.0.0.1"], "node-1": ["10.0.0.2"], "node-2": ["10.0.0.3", "fd00::3"]}
GLOO = (
    "error: RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [{ip}]:31448. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF!"
)
IP_RE = re.compile(r"\d+\.\d+\.\d+\.\d+|fd00::")


class RunBuilder:
    """A run directory's records, attempt by attempt, on an explicit clock."""

    def __init__(self, run_dir: Path, addrs: dict[str, list[str]] | None = ADDRS) -> None:
        self.run_dir, self.addrs = run_dir, addrs
        self.t = T0
        self.ledger: list[dict[str, Any]] = []
        self.ranks: dict[int, list[dict[str, Any]]] = {}
        self.number = 0
        self.first_step_t: dict[int, float] = {}

    def attempt(
        self,
        nodes: dict[int, str],
        last: int,
        *,
        restored: int = 0,
        startup_s: float = 2.0,
        gap_s: float = 10.0,
        ends: dict[int, str | None] | None = None,
        job_end: str | None = "finished",
        stop: dict[int, int] | None = None,
        saves: dict[int, str | None] | None = None,
        misses: dict[int, int] | None = None,
        end_after_s: float = 0.0,
    ) -> int:
        """One attempt: ranks on ``nodes`` run steps ``restored+1 .. last`` (rank r only up
        to ``stop[r]``); ``ends``: rank -> its rank_end reason (None: no rank_end);
        ``job_end``: rank 0's (None: none); ``saves``: step -> error (None: ok);
        ``misses``: rank -> cache misses per step. Returns the attempt's number."""
        a = self.number
        self.number += 1
        if self.ledger:
            self.t += gap_s
        self.t += startup_s
        start = {"type": "job_start", "t": self.t, "attempt": a, "world_size": len(nodes),
                 "restored_step": restored, "startup_s": startup_s, "restore_s": 0.0,
                 "config": {}, "device": "cpu"}  # fmt: skip
        self.ledger.append(start)
        for r, node in nodes.items():
            rs = {"type": "rank_start", "t": self.t, "attempt": a, "rank": r, "node": node,
                  "local_rank": 0, "world_size": len(nodes), "device": "cpu", "pid": 100 + r}  # fmt: skip
            if self.addrs is not None:
                rs["addrs"] = self.addrs.get(node, [])
            self.ranks.setdefault(r, []).append(rs)
        stop, saves, misses = stop or {}, saves or {}, misses or {}
        for step in range(restored + 1, last + 1):
            self.t += STEP_S
            self.first_step_t.setdefault(a, self.t)
            for r in nodes:
                if step <= stop.get(r, last):
                    self.ranks[r].append(
                        {
                            "type": "rank_step",
                            "step": step,
                            "attempt": a,
                            "t": self.t,
                            "step_s": STEP_S,
                            "data_wait_s": 0.01,
                            "bytes_read": 1000,
                            "cache_hits": 1,
                            "cache_misses": misses.get(r, 0),
                        }  # fmt: skip
                    )
            if step <= stop.get(0, last):
                self.ledger.append({"type": "step", "t": self.t, "step": step, "tokens": 64,
                                    "step_s": STEP_S, "data_wait_s": 0.01,
                                    "checkpoint_block_s": 0.0})  # fmt: skip
            if step in saves:
                err = saves[step]
                self.ledger.append({"type": "checkpoint", "t": self.t, "step": step,
                                    "block_s": 0.1, "durable_s": 0.2, "ok": err is None,
                                    "path": "", "error": err})  # fmt: skip
        self.t += end_after_s
        ends = {r: "finished" for r in nodes} if ends is None else ends
        for r, reason in ends.items():
            if reason is not None:
                self.ranks[r].append({"type": "rank_end", "t": self.t, "attempt": a,
                                      "step": min(last, stop.get(r, last)), "reason": reason})  # fmt: skip
        if job_end is not None:
            self.ledger.append({"type": "job_end", "t": self.t, "step": min(last, stop.get(0, last)),
                                "reason": job_end})  # fmt: skip
        return a

    def event(self, rec: dict[str, Any]) -> None:
        self.ledger.append({"t": self.t, **rec})

    def write(self) -> Path:
        led = Ledger(self.run_dir)
        led.write(self.ledger, durable=True)
        led.close()
        for r, recs in self.ranks.items():
            f = RankFile(self.run_dir, r, snapshot_every=7)  # snapshots mid-file too
            for i in range(0, len(recs), 5):
                f.write(recs[i : i + 5])
            f.close()
        return self.run_dir


def _no_ip(incidents: list[Any]) -> None:
    text = json.dumps([i.to_dict() for i in incidents])  # and plain JSON
    assert not IP_RE.search(text), IP_RE.search(text)


def _lost_node_run(tmp_path: Path, spare: bool, remote: bool = False) -> Path:
    """node-1 dies after step 10 in attempt 0 (its rank's newest records, past step 9,
    die with it; rank 0's collective fails naming node-1's address; the save of step 10
    fails with it); attempt 1 restores step 6 on node-0 alone, or with spare node-2 in
    rank 1's seat."""
    b = RunBuilder(tmp_path)
    b.attempt(
        {0: "node-0", 1: "node-1"},
        10,
        stop={1: 9},
        ends={0: GLOO.format(ip="10.0.0.2"), 1: None},
        job_end=GLOO.format(ip="10.0.0.2"),
        saves={6: None, 10: "checkpoint group failed: Connection reset by peer [10.0.0.2]:4"},
    )
    nodes = {0: "node-0", 1: "node-2"} if spare else {0: "node-0"}
    b.attempt(nodes, 30, restored=6, gap_s=12.0, misses={1: 3} if remote else None)
    return b.write()


@pytest.mark.parametrize("spare", [False, True])
def test_node_loss_names_the_node_the_seat_and_folds_the_failed_save(
    tmp_path: Path, spare: bool
) -> None:
    [inc] = detect(load(_lost_node_run(tmp_path, spare)))  # one incident: no crash, no save
    assert inc.kind == "node-loss"
    assert inc.nodes == ["node-1"] and inc.ranks == [1]
    assert inc.first_step == 10 and inc.last_step == 10 and inc.attempt == 0
    ev = inc.evidence
    assert ev["last_recorded_step"] == 9
    assert [s["step"] for s in ev["checkpoint_failed"]] == [10]
    assert ev["checkpoint_failed"][0]["cause"] == "peer gone"
    # cost: steps 7..10 redone + the wait from step 10 to attempt 1's job_start
    assert ev["steps_redone"] == 4 and ev["restart_s"] == pytest.approx(12.0 + 2.0)
    assert inc.lost_s == pytest.approx(4 * STEP_S + 14.0)
    if spare:
        assert ev["spare"] == "node-2" and ev["world_after"] == 2
        assert ev["spare_read_remotely"] is False
        assert ev["spare_first_steps"]["cache_misses"] == 0
        assert "spare node-2 took the seat" in inc.message
    else:
        assert ev["spare"] is None and (ev["world_before"], ev["world_after"]) == (2, 1)
        assert "no spare" in inc.message
    assert "peer node-1" in ev["reason"]
    _no_ip([inc])


def test_node_loss_spare_that_read_remotely(tmp_path: Path) -> None:
    [inc] = detect(load(_lost_node_run(tmp_path, spare=True, remote=True)))
    assert inc.kind == "node-loss" and inc.evidence["spare"] == "node-2"
    assert inc.evidence["spare_read_remotely"] is True
    # 3 misses a step over the spare's first 10 steps (EARLY_STEPS)
    assert inc.evidence["spare_first_steps"] == {
        "steps": 10, "cache_misses": 30, "cache_hits": 10, "bytes_read": 10_000,
    }  # fmt: skip
    assert "read remotely" in inc.message


def test_node_drained_with_sigterm_is_a_node_loss(tmp_path: Path) -> None:
    """node-1 is taken away (its rank leaves on SIGTERM) and the job goes on without it;
    the rank files carry no addresses, so nothing names it but its absence."""
    b = RunBuilder(tmp_path, addrs=None)
    b.attempt({0: "node-0", 1: "node-1"}, 10, saves={8: None},
              ends={0: GLOO.format(ip="10.0.0.2"), 1: "signal: SIGTERM"},
              job_end=GLOO.format(ip="10.0.0.2"))  # fmt: skip
    b.attempt({0: "node-0"}, 20, restored=8)
    [inc] = detect(load(b.write()))
    assert inc.kind == "node-loss" and inc.nodes == ["node-1"] and inc.ranks == [1]
    assert inc.evidence["how_it_stopped"] == {"node-1": "signal: SIGTERM"}
    _no_ip([inc])


def test_crash_is_named_by_rank_and_node_never_by_address(tmp_path: Path) -> None:
    """Rank 1 on node-1 is killed at step 5 (no rank_end); rank 0's gloo error names
    node-1's address; node-1 comes back in attempt 1, so it is a crash, not a node loss."""
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 6, stop={1: 5},
              ends={0: GLOO.format(ip="10.0.0.2"), 1: None}, job_end=GLOO.format(ip="10.0.0.2"),
              saves={4: None})  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 12, restored=4, gap_s=3.0)
    [inc] = detect(load(b.write()))
    assert inc.kind == "crash"
    assert inc.nodes == ["node-1"] and inc.ranks == [1] and inc.first_step == 6
    assert inc.evidence["culprit"] == "silent"
    assert inc.evidence["culprit_last_recorded_step"] == 5
    assert "Connection closed by peer node-1" in inc.message
    assert "rank 1 on node-1 died without a word" in inc.message
    assert inc.evidence["steps_redone"] == 2
    assert inc.lost_s == pytest.approx(2 * STEP_S + 3.0 + 2.0)
    _no_ip([inc])


def test_unknown_address_is_redacted_to_a_peer(tmp_path: Path) -> None:
    """Rank files without ``addrs`` (an older run): the address becomes "a peer"."""
    b = RunBuilder(tmp_path, addrs=None)
    b.attempt({0: "node-0", 1: "node-1"}, 6, stop={1: 5},
              ends={0: GLOO.format(ip="10.9.8.7"), 1: None}, job_end=GLOO.format(ip="10.9.8.7"))  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 12, restored=4)
    [inc] = detect(load(b.write()))
    assert inc.kind == "crash" and inc.nodes == ["node-1"] and inc.ranks == [1]
    assert "Connection closed by a peer" in inc.message
    _no_ip([inc])


def test_crash_blames_the_rank_that_raised_not_the_ones_stopped_after_it(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-0", 2: "node-1"}, 9,
              ends={0: "signal: SIGTERM", 1: "error: ValueError: batch has NaN tokens",
                    2: GLOO.format(ip="10.0.0.1")},
              job_end="signal: SIGTERM")  # fmt: skip
    b.attempt({0: "node-0", 1: "node-0", 2: "node-1"}, 20, restored=8)
    [inc] = detect(load(b.write()))
    assert inc.kind == "crash" and inc.ranks == [1] and inc.nodes == ["node-0"]
    assert inc.evidence["culprit"] == "raised"
    assert "ValueError: batch has NaN tokens" in inc.message


def _hang_run(tmp_path: Path, reaper: bool) -> tuple[Path, dict[str, Any]]:
    """Rank 1 on node-1 is SIGSTOPped after step 7: rank 0's watchdog answers (waiting in
    the all-reduce), rank 1 never does, so the hang record names rank 1 but no node."""
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 7, ends={}, job_end=None, saves={4: None})
    progress_t = b.t
    b.t += 3.5
    hang = {"type": "hang", "attempt": 0, "step": 7, "phase": "step", "stuck_ranks": [1],
            "nodes": [], "frame": None, "cause": "no response",
            "stuck": [{"rank": 1, "node": None, "frame": None, "state": "no_response"}],
            "missing_ranks": [1], "world_size": 2, "progress_t": progress_t,
            "detect_t": progress_t + 3.5, "detect_s": 3.5, "deadline_s": 3.0,
            "kill_t": progress_t + 4.0, "dump_dir": "hangs/attempt-0", "recovered": False}  # fmt: skip
    b.event(hang)
    d = hang_dir(tmp_path, 0)
    d.mkdir(parents=True)
    verdict = {"rank": 0, "node": "node-0", "pid": 100, "attempt": 0, "world_size": 2,
               "step": 7, "phase": "step", "since_progress_s": 3.5, "deadline_s": 3.0,
               "detect_t": progress_t + 3.5, "progress_t": progress_t,
               "frame": "distributed_c10d.py:2500 all_reduce", "state": "waiting",
               "waiting_in": "all_reduce", "stack": []}  # fmt: skip
    (d / "rank-0.json").write_text(json.dumps(verdict))
    if reaper:
        (d / "reaped-rank-1.json").write_text(json.dumps(
            {"rank": 1, "node": "node-1", "pid": 101, "proc_state": "T",
             "proc_state_name": "stopped", "signal": "SIGKILL", "t": progress_t + 4.0}))  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=4, gap_s=2.0)
    b.write()
    return tmp_path, {"progress_t": progress_t, "first_t": b.first_step_t[1]}


@pytest.mark.parametrize("reaper", [False, True])
def test_hang_of_a_rank_that_never_answered_is_placed_by_its_rank_file(
    tmp_path: Path, reaper: bool
) -> None:
    run, times = _hang_run(tmp_path, reaper)
    [inc] = detect(load(run))
    assert inc.kind == "hang"
    assert inc.ranks == [1] and inc.nodes == ["node-1"]  # the record itself said nodes: []
    assert inc.first_step == 7 and inc.attempt == 0
    ev = inc.evidence
    assert ev["phase"] == "step" and ev["detect_s"] == pytest.approx(3.5)
    assert ev["state"] == ("stopped" if reaper else "no response")
    assert ev["stuck"][0]["node"] == "node-1"
    # from the last progress to the restart's first step, plus steps 5..7 redone
    wait = times["first_t"] - times["progress_t"]
    assert ev["restart_s"] == pytest.approx(wait) and ev["steps_redone"] == 3
    assert inc.lost_s == pytest.approx(wait + 3 * STEP_S)
    if reaper:
        assert "stopped when the reaper killed it" in inc.message
    _no_ip([inc])


def _rank_0_silent(tmp_path: Path) -> tuple[RunBuilder, Path, dict[str, Any]]:
    """Rank 0 stuck after step 7 with no ledger hang record; rank 1's verdict waits in the
    all-reduce. (builder, the hang directory, rank 1's verdict)."""
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 7, ends={}, job_end=None)
    d = hang_dir(tmp_path, 0)
    d.mkdir(parents=True)
    verdict = {"rank": 1, "node": "node-1", "world_size": 2, "step": 7, "phase": "step",
               "since_progress_s": 4.0, "deadline_s": 3.0, "detect_t": b.t + 4.0,
               "progress_t": b.t, "frame": "/opt/lib/site-packages/torch/x.py:1 all_reduce",
               "state": "waiting", "waiting_in": "all_reduce"}  # fmt: skip
    (d / "rank-1.json").write_text(json.dumps(verdict))
    return b, d, verdict


def test_hang_from_verdicts_alone_blames_the_silent_rank_0(tmp_path: Path) -> None:
    """Rank 0 itself is stuck (no ledger hang record: it could not write one, and no later
    rank 0 recovered it): rank 1's verdict waits in the all-reduce; rank 0 never answered."""
    b, _, _ = _rank_0_silent(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=4)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.ranks == [0] and inc.nodes == ["node-0"]
    assert inc.evidence["state"] == "no response" and inc.evidence["cause"] == "no response"


def test_hang_verdicts_of_ranks_the_job_never_had_name_nobody(tmp_path: Path) -> None:
    """Files dropped into hangs/attempt-0/ for ranks 5 and 6 of a 2-rank attempt (a verdict
    that claims a world of 8, a reaper's record): the attempt's job_start says 2 ranks, so
    the culprit is still the silent rank 0 alone, never 5, 6 or the ranks 2..7 'missing'."""
    b, d, verdict = _rank_0_silent(tmp_path)
    forged = {**verdict, "rank": 5, "world_size": 8, "node": "node-9", "state": "stuck"}
    (d / "rank-5.json").write_text(json.dumps(forged))
    (d / "reaped-rank-6.json").write_text(json.dumps({"rank": 6, "node": "node-9"}))
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=4)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.ranks == [0] and inc.nodes == ["node-0"], inc.message
    assert "node-9" not in inc.message


def test_hang_record_with_fields_of_the_wrong_type_is_still_diagnosed(tmp_path: Path) -> None:
    """A ledger is a file: a hang record whose unchecked fields hold junk costs those
    fields, never the diagnosis."""
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 7, ends={}, job_end=None)
    b.event({"type": "hang", "attempt": 0, "step": 7, "stuck_ranks": [1],
             "stuck": ["x", {"rank": "one"}, {"rank": 1, "node": 5}], "progress_t": "soon",
             "detect_t": [1], "phase": {"a": 1}, "frame": 3})  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=4)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.ranks == [1] and inc.nodes == ["node-1"]
    assert inc.evidence["detect_s"] is None and inc.evidence["phase"] is None


def test_hang_ended_by_the_backend_timeout(tmp_path: Path) -> None:
    """No watchdog: both ranks fail on gloo's timeout 30 s after step 9; rank 0's error
    names node-1's address."""
    timeout = ("error: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81]"
               " Timed out waiting 30000ms for recv operation to complete from [10.0.0.2]:5")  # fmt: skip
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 9, end_after_s=30.0,
              ends={0: timeout, 1: "error: RuntimeError: Timed out waiting 30000ms for send"},
              job_end=timeout)  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=8)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.evidence["detected_by"] == "backend timeout"
    assert inc.nodes == ["node-1"] and inc.ranks == [1]
    assert inc.evidence["detect_s"] == pytest.approx(30.0)
    _no_ip([inc])


def test_backend_timeout_without_a_named_peer_names_every_rank(tmp_path: Path) -> None:
    """A partition: both sides time out waiting for each other and no error names an
    address: both ranks (and nodes) are named, as the watchdog names every waiting rank."""
    timeout = "error: RuntimeError: Timed out waiting 15000ms for recv operation to complete"
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 9, end_after_s=15.0, ends={0: timeout, 1: timeout},
              job_end=timeout)  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=8)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.first_step == inc.last_step == 9
    assert inc.nodes == ["node-0", "node-1"] and inc.ranks == [0, 1]
    assert "every rank waited" in inc.evidence["cause"]


def _shrunk_after_a_timeout(tmp_path: Path) -> RunBuilder:
    """Both ranks time out after step 9 (a partition); attempt 1 runs on node-0 alone from
    step 8 to step 10 and is stopped by SIGTERM."""
    timeout = "error: RuntimeError: Timed out waiting 15000ms for recv operation to complete"
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 9, end_after_s=15.0, ends={0: timeout, 1: timeout},
              job_end=timeout)  # fmt: skip
    b.attempt({0: "node-0"}, 10, restored=8, ends={0: "signal: SIGTERM"},
              job_end="signal: SIGTERM")  # fmt: skip
    return b


def test_a_partitioned_node_that_rejoins_late_is_the_hangs_cost_not_a_crash(
    tmp_path: Path,
) -> None:
    """The hang replay without its fix, in the suite's quiet run: node-1's rank timed out
    10 s after node-0's, so node-0's agent re-rendezvoused alone (attempt 1, world 1,
    resumed from step 8) and, when node-1 came back, stopped its worker with SIGTERM to
    admit it (attempt 2, both nodes, from step 8 again: attempt 1's steps 9-10 redone).
    That SIGTERM is the elastic agent at work, a consequence of the hang: its cost goes to
    the hang, and no crash is reported."""
    b = _shrunk_after_a_timeout(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 20, restored=8)
    [inc] = detect(load(b.write()))
    assert inc.kind == "hang" and inc.first_step == inc.last_step == 9, inc.message
    assert inc.nodes == ["node-0", "node-1"] and inc.attempt == 0
    [back] = inc.evidence["rejoined"]
    assert back["attempt"] == 1 and back["nodes"] == ["node-1"], back
    assert back["steps_redone"] == 2 and back["lost_s"] > 0, back
    assert inc.lost_s == pytest.approx(inc.evidence["lost_s"] + back["lost_s"])
    assert "node-1 rejoined" in inc.message, inc.message


def test_a_hang_that_comes_back_after_each_rejoin_is_a_restart_loop(tmp_path: Path) -> None:
    """The same partition three times, each followed by the restart that admitted node-1
    again: the rejoins neither count nor break the run of hangs, which is one loop."""
    b = _shrunk_after_a_timeout(tmp_path)
    timeout = "error: RuntimeError: Timed out waiting 15000ms for recv operation to complete"
    for _ in range(2):
        b.attempt({0: "node-0", 1: "node-1"}, 9, restored=8, end_after_s=15.0,
                  ends={0: timeout, 1: timeout}, job_end=timeout)  # fmt: skip
        b.attempt({0: "node-0"}, 10, restored=8, ends={0: "signal: SIGTERM"},
                  job_end="signal: SIGTERM")  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 9, restored=8, ends={}, job_end=None)
    [loop] = detect(load(b.write()))
    assert loop.kind == "restart-loop", loop.message
    assert loop.evidence["attempts"] == [0, 2, 4], loop.evidence


def test_a_signal_that_costs_steps_on_the_same_nodes_stays_a_crash(tmp_path: Path) -> None:
    """The same shape, but the attempt after the SIGTERM runs on no node more than the
    stopped one did: nobody was admitted, so it is a preemption that cost steps."""
    b = _shrunk_after_a_timeout(tmp_path)
    b.attempt({0: "node-0"}, 20, restored=8)
    kinds = [(i.kind, i.attempt) for i in detect(load(b.write()))]
    assert ("crash", 1) in kinds, kinds


@pytest.mark.parametrize(
    ("errors", "cause"),
    [
        (["commit failed: OSError: [Errno 28] No space left on device: 'ckpt/x'"] * 2, "disk"),
        (["commit failed: OSError: [Errno 30] Read-only file system"], "disk"),
        (["NoCredentialsError: Unable to locate credentials"], "store"),
        (["taking the checkpoint writer lease failed (LeaseLostError: held by job b)"], "lease"),
        (["ValueError: tensor 'x' changed shape\nTraceback (most recent call last):"], "other"),
    ],
)
def test_failed_save_names_its_cause(tmp_path: Path, errors: list[str], cause: str) -> None:
    b = RunBuilder(tmp_path)
    saves: dict[int, str | None] = {2: None}
    saves.update({4 + 2 * i: e for i, e in enumerate(errors)})
    saves[20] = None
    b.attempt({0: "node-0"}, 20, saves=saves)
    [inc] = detect(load(b.write()))
    assert inc.kind == "checkpoint" and inc.evidence["cause"] == cause
    assert inc.evidence["failed_saves"] == len(errors)
    assert inc.first_step == 4 and inc.last_step == 4 + 2 * (len(errors) - 1)
    if cause == "other":
        assert inc.message.endswith("ValueError: tensor 'x' changed shape")
    else:
        assert cause in inc.message and "switch to async_mode" not in inc.advice
    _no_ip([inc])


def test_failed_save_error_is_redacted(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    err = "commit failed: ClientError: PUT s3://AKIAXXXX:s3cr3tvalue@bucket/ckpt refused"
    b.attempt({0: "node-0"}, 10, saves={4: err, 8: None})
    [inc] = detect(load(b.write()))
    assert inc.evidence["cause"] == "store"
    assert "s3cr3tvalue" not in json.dumps(inc.to_dict())


def test_restart_loop_is_one_incident(tmp_path: Path) -> None:
    """Attempts 1..3 each die one step after restoring step 10 with the same error."""
    b = RunBuilder(tmp_path)
    err = "error: RuntimeError: CUDA error: an illegal memory access"
    # attempt 0 commits step 10 and then dies: a crash, but it made progress
    b.attempt({0: "node-0", 1: "node-1"}, 10, saves={10: None},
              ends={0: err, 1: "signal: SIGTERM"}, job_end=err)  # fmt: skip
    for _ in range(3):
        b.attempt({0: "node-0", 1: "node-1"}, 11, restored=10,
                  ends={0: err, 1: "signal: SIGTERM"}, job_end=err)  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 30, restored=10)
    incs = detect(load(b.write()))
    kinds = [i.kind for i in incs]
    assert kinds == ["crash", "restart-loop"], [i.message for i in incs]
    loop = incs[1]
    assert loop.evidence["attempts"] == [1, 2, 3] and loop.evidence["repeats"] == 3
    assert "illegal memory access" in loop.evidence["reason"]
    assert loop.ranks == [0] and loop.nodes == ["node-0"]
    assert loop.first_step == 10 and loop.last_step == 11
    _no_ip(incs)


def test_clean_restarts_are_no_incident(tmp_path: Path) -> None:
    """Attempt 0 finishes its max_steps; attempt 1 (resubmitted with more steps) is
    preempted: every rank leaves on SIGTERM right after committing its last step; attempt
    2 resumes there and finishes."""
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 10, saves={10: None})
    b.attempt({0: "node-0", 1: "node-1"}, 16, restored=10, saves={16: None},
              ends={0: "signal: SIGTERM", 1: "signal: SIGTERM"}, job_end="signal: SIGTERM")  # fmt: skip
    # rescheduled on node-0 and a new node-2 after the preemption: no node was "lost"
    b.attempt({0: "node-2", 1: "node-0"}, 30, restored=16, saves={30: None})
    assert detect(load(b.write())) == []


def test_preemption_that_loses_steps_is_a_crash(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 16, saves={10: None},
              ends={0: "signal: SIGTERM", 1: "signal: SIGTERM"}, job_end="signal: SIGTERM")  # fmt: skip
    b.attempt({0: "node-0", 1: "node-1"}, 30, restored=10)
    [inc] = detect(load(b.write()))
    assert inc.kind == "crash" and inc.evidence["culprit"] == "signalled"
    assert inc.evidence["steps_redone"] == 6


def test_running_attempt_without_job_end_is_no_crash(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 10, ends={}, job_end=None)
    assert detect(load(b.write())) == []


def test_words_map_every_address_of_a_node_and_no_shared_one() -> None:
    def summary(node: str, addrs: list[str]) -> Any:
        return type("S", (), {"attempts": [{"node": node, "addrs": addrs}]})

    class _Rec:
        class view:  # noqa: N801 - a stand-in for RanksView
            ranks = {
                1: summary("node-1", ["10.0.0.2", "172.17.0.1"]),
                2: summary("node-2", [*ADDRS["node-2"], "172.17.0.1"]),  # docker0 on both
            }

    w = Words(_Rec())  # type: ignore[arg-type]
    text = "peer [fd00::3]:80 and 10.0.0.3:22 and [10.1.1.1]:1 and /x/pair.cc:553"
    assert w.peers(text) == ["node-2"]
    assert w.line(text) == "peer node-2 and node-2 and a peer and /x/pair.cc:553"
    assert w.peers("from [172.17.0.1]:5") == [] and w.line("by peer [172.17.0.1]:5") == "by a peer"


def test_rank_start_records_the_host_addresses(tmp_path: Path) -> None:
    """The recorder's rank_start carries ``addrs`` and the reader keeps them per attempt."""
    rr = RankRecorder(tmp_path, rank=0, world_size=1, snapshot_every=10)
    rr.open()
    rr.write([{"type": "job_start", "t": T0, "device": "cpu"}])
    rr.close()
    [entry] = load(tmp_path).view.ranks[0].attempts
    assert entry["addrs"] == host_addrs()
    assert all(isinstance(a, str) and not a.startswith("127.") for a in entry["addrs"])


# gloo's words for one lost peer, as the survivor's error says it from attempt to attempt
GLOO_WORDINGS = (
    GLOO,
    "error: RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Read error [{ip}]:2391: Connection reset by peer",
    "error: DistBackendError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/"
    "unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete",
    "error: RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] "
    "Connection reset by peer [{ip}]:40212",
)
LOOP_TOTAL = 20


def restart_loop_run(tmp_path: Path, restarts: int = 3) -> RunBuilder:
    """The issue-42 restart loop: rank 1 on node-1 dies without a word at step 5 in every
    attempt; step 4's checkpoint committed in attempt 0, but the attempt died before its
    ``checkpoint`` record reached the ledger, so only the restores of step 4 (with the
    COMMIT's time) prove it; torchrun gives up after ``restarts`` restarts. Rank 0's error
    is a different gloo wording each time."""
    b = RunBuilder(tmp_path)
    for i in range(restarts + 1):
        err = GLOO_WORDINGS[i % len(GLOO_WORDINGS)].format(ip="10.0.0.2")
        b.attempt({0: "node-0", 1: "node-1"}, 5, restored=0 if i == 0 else 4, stop={1: 5},
                  ends={0: err, 1: None}, job_end=err)  # fmt: skip
    commit_t = next(r["t"] for r in b.ledger if r.get("step") == 4 and r["type"] == "step")
    ledger = []
    for r in b.ledger:
        if r["type"] == "job_start":
            r["total_steps"] = LOOP_TOTAL
        ledger.append(r)
        if r["type"] == "job_start" and r["restored_step"]:
            ledger.append({"type": "restore", "t": r["t"], "step": 4, "tier": "durable",
                           "restore_s": 0.0, "commit_t": commit_t + 0.05})  # fmt: skip
    b.ledger = ledger
    return b


def test_restart_loop_of_one_silent_rank_is_one_incident_in_its_own_words(
    tmp_path: Path,
) -> None:
    """gloo's several wordings of one lost peer are one cause, the culprit's own ("rank 1
    died without a word"), and the first attempt's crash at the same step is the loop's
    first time, not an incident of its own; the advice knows the job has stopped."""
    incs = detect(load(restart_loop_run(tmp_path).write()))
    [loop] = incs
    assert loop.kind == "restart-loop", [i.message for i in incs]
    assert loop.evidence["attempts"] == [0, 1, 2, 3] and loop.evidence["first_time"] == 0
    assert loop.evidence["repeats"] == 4
    assert loop.evidence["reason"].startswith("crash: rank 1 on node-1 died without a word")
    assert "peer" not in loop.evidence["reason"] and "4 of 4" in loop.message
    assert (loop.ranks, loop.nodes, loop.first_step, loop.last_step) == ([1], ["node-1"], 4, 5)
    assert "is stopped" in loop.advice and "stop the job first" not in loop.advice
    _no_ip(incs)


def test_restart_loop_still_restarting_says_stop_it(tmp_path: Path) -> None:
    b = restart_loop_run(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 5, restored=4, ends={}, job_end=None)  # running
    [loop] = detect(load(b.write()))
    assert loop.kind == "restart-loop" and "stop the job first" in loop.advice


def test_crash_not_restarted_is_not_told_it_resumed(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.attempt({0: "node-0", 1: "node-1"}, 6, stop={1: 5}, saves={4: None},
              ends={0: GLOO.format(ip="10.0.0.2"), 1: None}, job_end=GLOO.format(ip="10.0.0.2"))  # fmt: skip
    [inc] = detect(load(b.write()))
    assert inc.kind == "crash" and inc.evidence["restarted"] is False
    assert "resumed" not in inc.advice and "did not restart" in inc.advice
    # restarted, it says so
    b2 = RunBuilder(tmp_path / "again")
    b2.attempt({0: "node-0", 1: "node-1"}, 6, stop={1: 5}, saves={4: None},
               ends={0: GLOO.format(ip="10.0.0.2"), 1: None}, job_end=GLOO.format(ip="10.0.0.2"))  # fmt: skip
    b2.attempt({0: "node-0", 1: "node-1"}, 12, restored=4)
    [inc2] = detect(load(b2.write()))
    assert "restarted from step 4 in attempt 1" in inc2.advice


def test_job_state_finished_stopped_running(tmp_path: Path) -> None:
    """The report's first line: stopped by failures at step N of M, still running as of
    the last record, finished, stopped by a signal."""
    st = job_state(load(restart_loop_run(tmp_path / "loop").write()))
    assert (st["state"], st["cause"], st["step"], st["total_steps"], st["attempts"]) == (
        "stopped", "failures", 5, LOOP_TOTAL, 4)  # fmt: skip
    assert st["text"].startswith(f"job stopped by failures at step 5 of {LOOP_TOTAL}")

    b = RunBuilder(tmp_path / "running")
    b.attempt({0: "node-0", 1: "node-1"}, 7, ends={}, job_end=None)
    st = job_state(load(b.write()))
    assert st["state"] == "running" and "still running as of the last record" in st["text"]

    b = RunBuilder(tmp_path / "killed")  # rank 0 killed: no job_end, rank 1 saw it go
    b.attempt({0: "node-0", 1: "node-1"}, 7, ends={1: GLOO.format(ip="10.0.0.1")}, job_end=None)
    assert job_state(load(b.write()))["state"] == "stopped"

    b = RunBuilder(tmp_path / "done")
    b.attempt(
        {0: "node-0", 1: "node-1"}, 6, ends={0: "error: boom", 1: None}, job_end="error: boom"
    )
    b.attempt({0: "node-0", 1: "node-1"}, 30, restored=4)
    st = job_state(load(b.write()))
    assert (st["state"], st["step"], st["attempts"]) == ("finished", 30, 2)

    b = RunBuilder(tmp_path / "cancelled")
    b.attempt({0: "node-0", 1: "node-1"}, 9, ends={0: "signal: SIGTERM", 1: "signal: SIGTERM"},
              job_end="signal: SIGTERM")  # fmt: skip
    st = job_state(load(b.write()))
    assert (st["state"], st["cause"]) == ("stopped", "signal") and "signal" in st["text"]
