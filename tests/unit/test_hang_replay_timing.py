"""The hang replay's ``detect_s``: measured from the detecting rank's own last progress.

Rank 0 writes each step record after the step; the rank whose watchdog fires may have made
its last progress earlier (a node-harness run: 32 ms), so from rank 0's record a detection
exactly on the deadline read 2.978 s against a 3.0 s deadline, and the replay's "never
before the deadline" check failed on a correct watchdog.
"""

from __future__ import annotations

import json

from steadytrain.monitor.ledger import ledger_path
from steadytrain.testing.incidents.hang import FLOOR_S, _timing


def _write(run_dir, records) -> None:
    path = ledger_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_detect_s_counts_from_the_detecting_ranks_own_progress(tmp_path) -> None:
    t0 = 1_000_000.0
    progress = t0 + 9.378  # rank 1's last progress: before rank 0's step record
    detect = progress + FLOOR_S + 0.01  # on its deadline
    _write(
        tmp_path,
        [
            {"type": "job_start", "t": t0},
            *({"type": "step", "t": t0 + s + 0.41, "step": s} for s in range(1, 10)),
            {"type": "hang", "t": detect, "step": 9, "phase": "step", "detect_t": detect,
             "progress_t": progress, "deadline_s": FLOOR_S},
            {"type": "job_start", "t": detect + 6},
        ],
    )  # fmt: skip
    timing = _timing(str(tmp_path), partitioned_t=t0 + 9.5)
    assert timing["detected_by"] == "watchdog" and timing["last_step"] == 9
    assert timing["detect_s"] >= FLOOR_S  # 2.978 from rank 0's step record (old code)
    assert abs(timing["detect_s"] - (FLOOR_S + 0.01)) < 1e-6


def test_without_a_hang_record_detect_s_counts_from_the_last_step_record(tmp_path) -> None:
    t0 = 1_000_000.0
    _write(
        tmp_path,
        [
            {"type": "job_start", "t": t0},
            *({"type": "step", "t": t0 + s, "step": s} for s in range(1, 10)),
            {"type": "job_end", "t": t0 + 9 + 15.2, "step": 9, "reason": "Timed out"},
            {"type": "job_start", "t": t0 + 30},
        ],
    )
    timing = _timing(str(tmp_path), partitioned_t=t0 + 9.2)
    assert timing["detected_by"] == "backend timeout"
    assert abs(timing["detect_s"] - 15.2) < 1e-6
