"""``run_demo_training(warm=SOCKET)``: what torchrun starts for each rank, and the line a
rank that started cold leaves in the demo's output. The run itself, forked from a real warm
process: ``tests/e2e/train/test_train_demo.py``."""

from __future__ import annotations

import os

from steadytrain.train.demo_run import _entry, _Presenter, train_entry


def test_each_rank_enters_the_warm_process_with_the_clis_preloading_file() -> None:
    assert _entry(False, "/run/warm.sock") == ["-m", "steadytrain.warm.enter", train_entry()]
    assert _entry(False, None) == ["-m", "steadytrain.cli"]  # fresh ranks
    assert _entry(True, "/run/warm.sock")[:2] == ["-m", "steadytrain.inplace.keeper"]
    assert os.path.isfile(train_entry()) and train_entry().endswith("train_entry.py")


def test_a_rank_that_started_cold_says_so_in_the_demo() -> None:
    line = "steadytrain.warm: no warm process at /x.sock (refused); starting cold"
    assert _Presenter()(line) == "[warm] no warm process at /x.sock (refused); starting cold"
