"""The keeper under srun without torchrun (``steadytrain.inplace.slurm``): torch's variables
from srun's, the store rank 0's keeper hosts, and its exit barrier (a real TCPStore; the
processes end to end: tests/integrations/test_run_inplace_slurm.py)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from steadytrain.inplace.slurm import (
    default_port,
    first_host,
    host_store,
    leave_together,
    slurm_ranks,
    tasks_on_node,
)
from steadytrain.testing.ports import free_ports

# What srun gives task 5 of 8 tasks, 4 per node, on the second node of two.
TASK = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[017-018]",
    "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node07", "node07"),
        ("node[07-09,12],gpu3", "node07"),
        ("gpu3,node[07-09]", "gpu3"),
        ("rack[2-3]-n[003,010]", "rack2-n003"),
        ("n[9]", "n9"),
    ],
)
def test_the_master_is_the_first_host_of_the_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_a_node_list_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(ValueError, match="first host"):
        first_host("node[07-09")


def test_the_tasks_per_node_are_read_from_slurms_compact_count() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="node 4 is not in"):
        tasks_on_node("2(x3),1", 4)
    with pytest.raises(ValueError, match="cannot read"):
        tasks_on_node("2x3", 0)


def test_srun_variables_give_torchs() -> None:
    assert slurm_ranks(TASK) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu017",
        "MASTER_PORT": str(default_port("123456")),
    }
    assert default_port("123456") == 18456  # the same job id gives every node the same port


def test_the_ranks_are_slurms_and_only_the_master_can_be_given() -> None:
    given = {
        **TASK,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    got = slurm_ranks(given)
    assert (got["RANK"], got["WORLD_SIZE"]) == ("5", "8")  # an exported RANK is every task's
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.1", "29400")


def test_not_under_srun_or_under_torchrun_nothing_is_derived() -> None:
    assert slurm_ranks({}) is None
    # The batch script's own process (as the harness's Slurm sets it): one process, no step.
    batch = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP_")}
    assert slurm_ranks({**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) is None
    assert slurm_ranks({**TASK, "TORCHELASTIC_RUN_ID": "job"}) is None  # srun torchrun ...


def test_a_missing_srun_variable_is_named_with_the_fix() -> None:
    partial = {k: v for k, v in TASK.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")}
    with pytest.raises(ValueError, match="srun did not set SLURM_NTASKS: start the keeper"):
        slurm_ranks(partial)


def test_a_port_in_use_stops_rank_0s_keeper_with_the_fix() -> None:
    held = host_store("localhost", free_ports(1)[0])
    try:
        with pytest.raises(SystemExit, match="could not host the store on port .*set MASTER_PORT"):
            host_store("localhost", held.port)
    finally:
        del held


def test_rank_0s_keeper_leaves_only_once_every_rank_ended(monkeypatch, capsys) -> None:
    hosted = host_store("localhost", free_ports(1)[0])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(hosted.port))
    left = threading.Event()

    def rank0() -> None:
        leave_together(hosted, world=3, timeout_s=60)
        left.set()

    waiter = threading.Thread(target=rank0)
    waiter.start()
    leave_together(None, world=3)  # rank 1's keeper: counts itself, does not wait
    assert not left.wait(1.0), "rank 0's keeper left before rank 2 ended"
    code = "from steadytrain.inplace.slurm import leave_together; leave_together(None, 3)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # rank 2, a client
    assert left.wait(30), "rank 0's keeper still waits after every rank ended"
    waiter.join()
    assert "leaving without" not in capsys.readouterr().err
    client = dist.TCPStore(
        "127.0.0.1", hosted.port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    assert client.add("steadytrain/inplace/keepers_done", 0) == 3


def test_rank_0s_keeper_warns_and_leaves_when_a_rank_never_ends(capsys) -> None:
    hosted = host_store("localhost", free_ports(1)[0])
    leave_together(hosted, world=2, timeout_s=0.5)
    assert "leaving without every rank's end (1 of 2 ranks ended within 0.5 s)" in (
        capsys.readouterr().err
    )
