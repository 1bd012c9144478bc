"""In-place recovery in ``Run``: the decision (``run_inplace.decide``), the fallback reasons
(``classify``), the ledger record and the config (pure; the real recovery is
tests/integrations/test_run_inplace.py)."""

from __future__ import annotations

import pytest

from steadytrain.errors import ConfigError
from steadytrain.inplace.contract import ENV_ON
from steadytrain.monitor.records import LEDGER_FIELDS, check_record
from steadytrain.run import Run
from steadytrain.run_inplace import (
    RecoveryConfig,
    classify,
    decide,
    recovery_config,
    recovery_record,
)

ON = RecoveryConfig(inplace=True)
KEEPER = {ENV_ON: "1"}


def _decide(cfg=ON, env=KEEPER, world=2, group=False, rebuildable=True) -> tuple[bool, str]:
    return decide(
        cfg, env, world_size=world, group_exists=group, rebuildable_checkpoint=rebuildable
    )


def test_in_place_only_when_asked_under_the_keeper_and_sure() -> None:
    assert _decide() == (True, "under the keeper, on a store that outlives the training processes")
    cases = {
        "recovery.inplace is off": _decide(cfg=RecoveryConfig()),
        "not under the keeper": _decide(env={}),
        "the keeper turned it off": _decide(env={ENV_ON: "0"}),
        "a single rank": _decide(world=1),
        "the process group existed before Run": _decide(group=True),
        "a ready-made checkpointer": _decide(rebuildable=False),
    }
    for words, (on, why) in cases.items():
        assert on is False and words in why, (words, why)


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("rank 0: could not form a new process group in place within 3 s (...)", "regroup_timeout"),
        ("no snapshot step is held by every rank (rank 0: [3]; rank 1: [])", "no_common_step"),
        (
            "rank 1: FSDP2's shards are each rank's own and the memory tier is off "
            "(checkpoint.memory.every_steps), so no snapshot step is held by every rank",
            "no_common_step",
        ),
        (
            "rank 0: no snapshot step is held by every rank in the memory tier (...)",
            "no_common_step",
        ),
        ("every rank is a replacement: no process kept its state", "no_survivor"),
        ("rank 1: a peer was lost again after 3 in-place regroups", "repeated_fault"),
        ("the training process was killed by SIGKILL before it completed a step", "repeated_fault"),
        ("3 in-place recoveries already (max_recoveries)", "repeated_fault"),
        ("rank 0: in-place restore failed (KeyError: 'x')", "restore_failed"),
        ("the training process exited with status 1 (its own verdict, not a fault)", "exit_status"),
        ("the training process was killed by SIGTERM, not a process fault", "not_a_process_fault"),
        ("something new", "other"),
    ],
)
def test_a_fallback_is_named_by_its_reason(message: str, kind: str) -> None:
    assert classify(message) == kind
    rec = recovery_record(
        path="whole_restart",
        failed_ranks=[1],
        from_step=7,
        step=None,
        phases={},
        why=message,
        attempt=1,
    )
    assert rec["fallback"] == kind and rec["why"] == message


def test_the_record_is_a_valid_ledger_record_and_refuses_an_unknown_path() -> None:
    rec = recovery_record(
        path="in_place",
        failed_ranks=[3, 1],
        from_step=7,
        step=6,
        phases={"detection_s": 0.1, "regroup_s": -0.01},
        why="x",
        attempt=2,
        t=1.0e9,
    )
    assert rec["failed_ranks"] == [1, 3] and "fallback" not in rec
    assert rec["phases"]["regroup_s"] == 0.0  # a clock that disagrees is clamped
    assert check_record(rec, LEDGER_FIELDS) is None
    assert check_record({**rec, "path": None}, LEDGER_FIELDS) is not None
    with pytest.raises(ValueError, match="path must be"):
        recovery_record(
            path="elsewhere", failed_ranks=[], from_step=0, step=0, phases={}, why="", attempt=0
        )


def test_the_config_is_checked_with_the_key_and_the_fix() -> None:
    assert recovery_config(None) == RecoveryConfig()
    assert recovery_config({"inplace": True, "every_steps": 5}).every_steps == 5
    with pytest.raises(ConfigError, match=r"unknown recovery key\(s\) \['in_place'\]"):
        recovery_config({"in_place": True})
    assert recovery_config(None).every_steps == 0  # live recovery alone, no snapshot
    assert recovery_config({"every_steps": 0}).every_steps == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="recovery.every_steps must be an integer >= 0"):
            recovery_config({"every_steps": bad})
    with pytest.raises(ConfigError, match="recovery.inplace must be true or false"):
        recovery_config({"inplace": "yes"})


def test_a_run_asked_for_in_place_outside_the_keeper_says_why_and_trains(tmp_path, monkeypatch):
    """Outside the keeper the option is a no-op with one line saying so: the job runs as
    today (a fault costs the whole restart)."""
    monkeypatch.delenv(ENV_ON, raising=False)
    said: list[str] = []
    with Run(tmp_path, {}, checkpoint=False, recovery={"inplace": True}, say=said.append) as run:
        with run.recoverable(run.step) as s:
            run.step_done(1)
        assert s.next == 1 and not s.recovered
        assert run.wrap(lambda: "built") == "built"
    assert any("in-place recovery is off: not under the keeper" in m for m in said), said


def test_the_report_lists_each_recovery_with_its_path_reason_and_phases() -> None:
    from steadytrain.report.recoveries import recoveries_html, recovery_lines, recovery_rows

    in_place = recovery_record(
        path="in_place",
        failed_ranks=[1],
        from_step=7,
        step=6,
        attempt=1,
        why="lost",
        phases={"detection_s": 0.1, "regroup_s": 0.5, "restore_s": 0.2, "redo_s": 0.2},
    )
    fell_back = recovery_record(
        path="whole_restart",
        failed_ranks=[0],
        from_step=20,
        step=None,
        phases={},
        attempt=3,
        why="the training process was killed by SIGKILL before it completed a step",
    )
    hostile = {"type": "inplace_recovery", "path": "in_place", "phases": {"regroup_s": -5, "x": 1}}
    events = [{"type": "job_start"}, in_place, fell_back, hostile, {**in_place, "path": "?"}]
    rows = recovery_rows(events)
    assert [r["path"] for r in rows] == ["in_place", "whole_restart", "in_place"]
    assert rows[0]["wall_s"] == pytest.approx(1.0) and rows[2]["phases"] == {}
    lines = recovery_lines({"recoveries": rows})
    assert lines[0] == (
        "recovery in place (attempt 1): rank 1 lost at step 7, rolled back to 6, 1.00 s: "
        "detection 0.10 s, regroup 0.50 s, restore 0.20 s, redo 0.20 s"
    )
    assert lines[1].startswith("recovery by whole restart (before attempt 3): rank 0 at step 20: ")
    assert "repeated_fault" in lines[1]
    html = recoveries_html({"recoveries": rows})
    assert html.count("<tr><td>") == 3 and "whole restart" in html and "repeated_fault" in html


def test_the_keeper_preloads_an_optional_import_and_the_train_entrys_lazy_modules(tmp_path):
    """A top-level ``try: import x`` is preloaded too (an optional module), so the file the
    keeper runs for ``steadytrain train`` names the modules a replaced process would
    otherwise import again: the training loop and MLflow."""
    import steadytrain.inplace.train_entry as entry
    from steadytrain.inplace.keeper import imports_of

    script = tmp_path / "train.py"
    script.write_text("import os\ntry:\n    import mlflow\nexcept ImportError:\n    pass\n")
    assert imports_of(str(script)) == ["os", "mlflow"]
    assert {"steadytrain.train.loop", "steadytrain.cli", "mlflow"} <= set(
        imports_of(entry.__file__)
    )


def test_a_fallback_left_in_the_store_becomes_the_next_attempts_whole_restart_record(
    tmp_path, monkeypatch
) -> None:
    """The keeper (or a survivor's InPlaceFallback) notes why attempt 0 fell back to the
    whole restart in torchrun's store; attempt 1's rank 0 writes it into the ledger as an
    ``inplace_recovery`` of path ``whole_restart`` with the reason. A real TCPStore and a
    real meter; only rank 1's note exists, so only rank 1 is named."""
    import datetime
    import json
    import types

    import torch.distributed as dist

    from steadytrain.inplace.recovery import Recovery
    from steadytrain.monitor.meter import GoodputMeter
    from steadytrain.run_inplace_step import InPlaceLedger, note_fallback
    from steadytrain.testing.ports import free_ports

    port = free_ports(1)[0]
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    why = "process killed by SIGKILL: the training process was killed by SIGKILL before it completed a step"
    note_fallback(server, 0, 1, why, None)
    meter = GoodputMeter(tmp_path, sinks=("jsonl",), total_steps=10)
    run = types.SimpleNamespace(rank=0, world_size=2, meter=meter, start_step=4, attempt=1)
    ledger = InPlaceLedger(types.SimpleNamespace(recovery=Recovery(replicated={})))
    ledger.started(run, replaced=False)
    meter.close()
    recs = [json.loads(line) for line in open(tmp_path / "ledger.jsonl")]
    (rec,) = [r for r in recs if r["type"] == "inplace_recovery"]
    assert (rec["path"], rec["failed_ranks"], rec["fallback"], rec["why"]) == (
        "whole_restart",
        [1],
        "repeated_fault",
        why,
    )
    assert rec["from_step"] == 4 and rec["step"] is None and rec["attempt"] == 1


def test_the_demo_shows_the_keepers_verdicts() -> None:
    from steadytrain.train.demo_run import _Presenter

    show = _Presenter()
    line = (
        "steadytrain.inplace: rank 0: process 12 killed by SIGKILL; replacing it in place (1 of 3)"
    )
    assert (
        show(line)
        == "[keeper] rank 0: process 12 killed by SIGKILL; replacing it in place (1 of 3)"
    )


def test_the_keepers_verdict_leaves_the_reason_its_process_noted_first() -> None:
    """A survivor (or an FSDP2 replacement) that gives up notes why, then exits with status
    1; its keeper's verdict on that exit ("its own verdict") must not hide the reason."""
    import json

    import torch.distributed as dist

    from steadytrain.run_inplace_step import fallback_key, note_fallback

    store = dist.HashStore()
    why = "rank 1: no snapshot step is held by every rank in the memory tier"
    note_fallback(store, 0, 1, why, 7)
    note_fallback(store, 0, 1, "exited with status 1 (its own verdict)", None, keep_existing=True)
    note_fallback(store, 0, 0, "exited with status 1 (its own verdict)", None, keep_existing=True)
    assert json.loads(store.get(fallback_key(0, 1))) == {"why": why, "step": 7}
    assert "its own verdict" in json.loads(store.get(fallback_key(0, 0)))["why"]


def test_fsdp2_follows_a_renewed_default_group_or_says_why_not() -> None:
    """FSDP2 keeps the group object it resolved at ``fully_shard``; after the default group
    is destroyed and formed again (a regroup) ``fsdp_rebind_groups`` points it at the new
    one, and refuses, changing nothing, a mesh that is not the old default group. One
    process, a real gloo group (world size 1)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from steadytrain.checkpoint.torch_private import fsdp_rebind_groups

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model[0])
        fully_shard(model)
        info = model[0]._get_fsdp_state()._fsdp_param_group.mesh_info
        old = dist.group.WORLD
        assert info.shard_process_group is old
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.group.WORLD is not old and info.shard_process_group is old
        why = fsdp_rebind_groups([model], "elsewhere")
        assert "not the default group 'elsewhere'" in why and info.shard_process_group is old
        assert fsdp_rebind_groups([model], old.group_name) is None
        assert info.shard_process_group is dist.group.WORLD
        model(torch.ones(2, 4)).sum().backward()  # the rebound module still trains
    finally:
        dist.destroy_process_group()
