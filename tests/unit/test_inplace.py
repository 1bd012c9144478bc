"""The pure parts of in-place recovery: the keeper's policy, the agreed step, the preload list,
and which errors count as a lost peer (the real processes: tests/integrations/test_inplace.py)."""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch.distributed as dist

from steadytrain.inplace.keeper import imports_of
from steadytrain.inplace.policy import Death, Policy
from steadytrain.inplace.regroup import InPlaceFallback, Report, agree, is_peer_loss, not_live
from steadytrain.run_inplace import classify

KILL = -signal.SIGKILL


def test_a_signal_death_after_a_step_is_recovered_until_the_limit() -> None:
    policy = Policy(max_recoveries=2)
    assert policy.verdict(Death(KILL, stepped=True), recovered=0) is None
    assert policy.verdict(Death(-signal.SIGSEGV, stepped=True), recovered=1) is None
    assert "2 in-place recoveries already" in policy.verdict(Death(KILL, True), recovered=2)


@pytest.mark.parametrize(
    "death, why",
    [
        (Death(1, stepped=True), "exited with status 1 (its own verdict"),
        (Death(0, stepped=True), "exited with status 0"),
        (Death(-signal.SIGTERM, stepped=True), "SIGTERM, not a process fault"),
        (Death(KILL, stepped=False), "before it completed a step"),
    ],
)
def test_everything_else_goes_to_the_whole_restart(death: Death, why: str) -> None:
    assert why in Policy(max_recoveries=5).verdict(death, recovered=0)


def test_max_recoveries_zero_turns_it_off_and_a_negative_one_is_refused() -> None:
    assert "0 in-place recoveries already" in Policy(0).verdict(Death(KILL, True), 0)
    with pytest.raises(ValueError, match="max_recoveries must be >= 0"):
        Policy(-1)


def test_the_step_is_the_newest_every_rank_holds_and_a_survivor_sends() -> None:
    """No survivor live (each stepped its optimizer in the failed step): the snapshots."""
    reports = [Report(0, (3, 6), False), Report(1, (3,), True), Report(2, (3, 6), False)]
    assert agree(reports) == (3, 0, False)
    reports = [Report(0, (6, 9), True), Report(1, (6, 9), False), Report(2, (6, 9), False)]
    assert agree(reports) == (9, 1, False)


def test_survivors_live_at_one_step_resume_it_from_their_live_state() -> None:
    """Every survivor holds the start of step 7 live and the replaced rank's per-rank state
    of 7 is in the store: step 7 from the lowest survivor's live state, no snapshot needed
    (and none taken: every_steps=0)."""
    reports = [Report(0, (), False, 7), Report(1, (), True, None, (6, 7)), Report(2, (), False, 7)]
    assert agree(reports) == (7, 0, True)
    # live beats an older snapshot every rank holds: nothing before 7 is redone
    reports = [Report(0, (6,), True, None, (7, 8)), Report(1, (6,), False, 8)]
    assert agree(reports) == (8, 1, True)


def test_a_rank_lost_in_its_optimizer_step_resumes_live_from_its_state_published_ahead() -> None:
    """Rank 1 died in its optimizer.step() of step 7 (after the gradient all-reduce): the
    survivors are live at 8, and its state of 8 is the one its optimizer's pre-hook published
    (``ahead``). Every survivor proved at the start of 8 that its own pre-hook publication
    was its true state: live at 8. One survivor that did not prove it (its loop changed a
    per-rank state after optimizer.step(), or it never checked 8): the snapshot."""
    proven = [
        Report(0, (6,), False, 8, proven=True),
        Report(1, (6,), True, None, (7, 8), ahead=(8,)),
        Report(2, (6,), False, 8, proven=True),
    ]
    assert not_live(proven) is None and agree(proven) == (8, 0, True)
    unproven = [dataclasses.replace(proven[0], proven=False), *proven[1:]]
    assert "survivor(s) [0] did not prove that right" in not_live(unproven)
    assert agree(unproven) == (6, 0, False)
    # a state written at the start of the step itself needs no proof
    written = [proven[0], dataclasses.replace(proven[1], ahead=(7,)), proven[2]]
    assert agree([dataclasses.replace(r, proven=False) for r in written]) == (8, 0, True)


@pytest.mark.parametrize(
    "reports, why",
    [
        # a survivor stepped its optimizer in the failed step (a collective after step())
        (
            [Report(0, (6,), False, None), Report(1, (6,), True, None, (7,))],
            "rank(s) [0] stepped their optimizer",
        ),
        # survivors at different steps (one passed the failed step's last collective)
        (
            [
                Report(0, (6,), False, 7),
                Report(1, (6,), True, None, (7, 8)),
                Report(2, (6,), False, 8),
            ],
            "the survivors are at different steps (rank 0 at 7, rank 2 at 8)",
        ),
        # the replaced rank's per-rank state of the live step never reached the store
        (
            [Report(0, (6,), False, 7), Report(1, (6,), True, None, (5, 6))],
            "no per-rank state of step 7 in the store for replaced rank(s) [1]",
        ),
        # its state of 8 was published ahead, and a survivor saw its own publication differ
        (
            [
                Report(0, (6,), False, 8, proven=True),
                Report(1, (6,), True, None, (7, 8), ahead=(8,)),
                Report(2, (6,), False, 8, proven=False),
            ],
            "survivor(s) [2] did not prove that right",
        ),
    ],
    ids=["stepped", "different-steps", "missing-own-state", "ahead-unproven"],
)
def test_not_live_takes_the_snapshot_or_falls_back(reports: list[Report], why: str) -> None:
    assert why in not_live(reports)
    assert agree(reports) == (6, min(r.rank for r in reports if not r.replaced), False)
    without = [dataclasses.replace(r, steps=()) for r in reports]  # live only
    with pytest.raises(InPlaceFallback, match="no snapshot step is held by every rank") as e:
        agree(without)
    assert why in str(e.value) and classify(str(e.value)) == "no_common_step"


def test_no_common_step_or_no_survivor_falls_back() -> None:
    with pytest.raises(InPlaceFallback, match=r"rank 0: \[6\]; rank 1: \[3\]"):
        agree([Report(0, (6,), False), Report(1, (3,), True)])
    with pytest.raises(InPlaceFallback, match="every rank is a replacement"):
        agree([Report(0, (6,), True, 6, (6,)), Report(1, (6,), True, 6, (6,))])


def test_the_preload_list_is_the_scripts_top_level_absolute_imports(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch.nn as nn\nfrom numpy import zeros\nfrom . import sibling\n"
        "if True:\n    import json\n\ndef f():\n    import csv\nimport os\n"
    )
    assert imports_of(str(script)) == ["os", "torch.nn", "numpy"]


def test_only_a_lost_peer_is_recovered() -> None:
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8580. This is")
    assert is_peer_loss(gloo)
    assert is_peer_loss(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert is_peer_loss(dist.DistNetworkError("x"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("Connection closed by peer"))


def test_a_thread_an_import_started_is_named_before_the_keeper_forks() -> None:
    import threading

    from steadytrain.inplace.keeper import foreign_threads

    before = foreign_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="started-by-an-import")
    t.start()
    try:
        assert foreign_threads() == [*before, "started-by-an-import"]
    finally:
        stop.set()
        t.join()


def test_a_snapshot_copies_into_the_evicted_one_and_never_aliases_the_live_state() -> None:
    import torch

    from steadytrain.inplace.recovery import copy_state

    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    live = {"model": model.state_dict(), "optim": optim.state_dict()}
    first = copy_state(live)
    weight = first["model"]["weight"]
    assert torch.equal(weight, model.weight) and weight.data_ptr() != model.weight.data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the snapshot does not move with it
    assert not torch.equal(first["model"]["weight"], model.weight)
    second = copy_state({"model": model.state_dict(), "optim": optim.state_dict()}, first)
    assert second["model"]["weight"].data_ptr() == weight.data_ptr()  # reused, not allocated
    assert torch.equal(second["model"]["weight"], model.weight)
    assert second["optim"]["param_groups"] == optim.state_dict()["param_groups"]
    grown = copy_state({"model": torch.nn.Linear(4, 5).state_dict()}, second)
    assert grown["model"]["weight"].shape == (5, 4)  # another shape: a fresh tensor


@pytest.mark.parametrize(
    ("ending", "status", "said"),
    [
        ("raise ValueError('boom')", 1, "hooked ValueError boom"),
        ("raise KeyboardInterrupt", -signal.SIGINT, "hooked KeyboardInterrupt"),
    ],
)
def test_the_keepers_training_process_reports_an_uncaught_exception_as_python_does(
    tmp_path, ending: str, status: int, said: str
) -> None:
    """Through the script's ``sys.excepthook`` (where steadytrain's trainer hooks book a
    crash's reason), and an uncaught KeyboardInterrupt ends the process, and so the keeper,
    by SIGINT, as ``python SCRIPT`` ends: what torchrun sees is the same with the keeper."""
    import sys

    from steadytrain.testing import forkserver

    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "sys.excepthook = lambda t, v, tb: print('hooked', t.__name__, v, file=sys.stderr)\n"
        + ending
        + "\n"
    )
    cmd = [sys.executable, "-m", "steadytrain.inplace.keeper", str(script)]
    r = forkserver.run(cmd, timeout=300)
    assert r.returncode == status, r.stderr
    assert said in [s.strip() for s in r.stderr.splitlines()], r.stderr  # the hook, no traceback


def test_the_keeper_freezes_what_it_made_before_it_forks(tmp_path) -> None:
    """A forked training process's full collection scans only the objects it made itself:
    a survivor's regroup collects the DDP it dropped, 0.18 s over torch's and the trainer's
    objects unfrozen against 0.012 s frozen (measured), while the replacement waits."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import gc, json\nprint(json.dumps([gc.get_freeze_count(), len(gc.get_objects())]))\n"
    )
    cmd = [sys.executable, "-m", "steadytrain.inplace.keeper", str(script)]
    # a fresh interpreter: the test fork server froze its own heap already
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    frozen, scanned = json.loads(r.stdout.strip().splitlines()[-1])
    assert frozen > 10 * scanned > 0, (frozen, scanned)  # torch's objects: out of sight


def test_the_trainers_entry_preloads_everything_its_mlflow_sink_imports(tmp_path) -> None:
    """A replaced rank 0 opens the MLflow sink again: whatever it still has to import then
    runs in the sink's thread, and its GIL slowed the first steps after a regroup (the
    SQLite store's modules: 0.8 s; the demo's first-step excess, 0.3 s -> 0.1 s)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("mlflow")
    probe = (
        "import json, sys\n"
        "from steadytrain.inplace.keeper import _preload\n"
        "from steadytrain.train.demo_run import train_entry\n"
        "_preload(train_entry())\n"
        "before = set(sys.modules)\n"
        "from steadytrain.monitor.mlflow_sink import MlflowSink\n"
        f"MlflowSink({str(tmp_path)!r}).close('finished')\n"
        "new = sorted(m for m in set(sys.modules) - before\n"
        "             if m.split('.')[0] in ('mlflow', 'sqlalchemy', 'alembic'))\n"
        "print(json.dumps(new))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mlflow.db").exists()  # the sink did open its store
    # A handful is left (the SQLite dialect, the store's migrations: 14 modules, 0.05 s of
    # the sink's opening); without the store's preload it was 288 (0.8 s).
    new = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(new) <= 25, new
    assert "mlflow.store.tracking.sqlalchemy_store" not in new
