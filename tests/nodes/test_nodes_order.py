"""The node tests' order: the tests that wait for a background replay (``replays`` in
conftest.py) run after every node test that waits for none, in the order the replays
finish, so the harness, Slurm, memory-tier and trainer tests run while the replays do."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import (  # noqa: E402
    FINISH_ORDER,
    LANES,
    REPLAY_MODULES,
    in_nodes,
    pytest_collection_modifyitems,
    waits_for,
)

pytestmark = pytest.mark.nodes


def test_every_replay_has_its_place_in_the_finish_order() -> None:
    assert sorted(FINISH_ORDER) == sorted(REPLAY_MODULES.values())
    assert sorted(FINISH_ORDER) == sorted(n for lane in LANES for n in lane)


def test_this_sessions_node_tests_wait_for_replays_last(request: pytest.FixtureRequest) -> None:
    """This session's own order (whatever was selected): no test that waits for nothing
    after one that waits, and the waiting ones by their replay's place in FINISH_ORDER."""
    nodes = [i for i in request.session.items if in_nodes(i)]
    ranks = [0 if (n := waits_for(i)) is None else 1 + FINISH_ORDER.index(n) for i in nodes]
    assert ranks == sorted(ranks), [(i.nodeid, r) for i, r in zip(nodes, ranks, strict=True)]


class _Item:
    """What the ordering reads of a collected test: its file and its fixtures."""

    def __init__(self, path: str, fixtures: tuple[str, ...] = ()) -> None:
        self.fspath = path if os.path.isabs(path) else os.path.join(HERE, path)
        self.fixturenames = list(fixtures)

    def __repr__(self) -> str:
        return f"{os.path.basename(self.fspath)}{self.fixturenames}"


def test_waiting_tests_move_after_the_others_in_finish_order() -> None:
    """The files' order put the matrix case first: it waited for the last replay of its
    lane while no other node test ran."""
    elsewhere = _Item(os.path.join(os.path.dirname(HERE), "e2e", "test_x.py"))
    case = _Item("test_diagnosis_matrix.py", ("replays", "matrix"))
    scoring = _Item("test_diagnosis_matrix.py", ("replays",))  # needs no harness
    memtier, slurm = _Item("test_memory_tier_nodes.py"), _Item("test_nodes_slurm.py")
    hang, storage = _Item("test_replay_hang.py"), _Item("test_replay_storage.py")
    items = [elsewhere, case, scoring, memtier, storage, hang, slurm]
    pytest_collection_modifyitems(items)
    assert items == [elsewhere, scoring, memtier, slurm, hang, storage, case], items
