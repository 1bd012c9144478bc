"""examples/hf_accelerate.py: Transformers (tiny random-init Llama) + Accelerate under
torchrun on 2 CPU ranks, with steadytrain's loader, async checkpoints and goodput ledger.

A run killed mid-step and restarted by torchrun resumes from its newest committed
checkpoint and ends with the per-step losses and final weights of an uninterrupted run; its
report shows the crash, a restart gap above 0 and "other" under 10 % (``steadytrain.Run``).
"""

from __future__ import annotations

import pytest
from example_runs import assert_bit_exact_resume, assert_crash_reported, run_pair

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_hf_accelerate_crash_resume_is_bit_exact(dataset: str, tmp_path) -> None:
    # Warm ranks: a warm run lasts ~5-20 s, so assert_crash_reported's bound on "other"
    # (10 %) needs every second booked: the crashed attempt's last step to its crash job_end
    # is restart_gap, the final save's closing wait checkpoint_block (monitor/goodput.py).
    ref, crashed = run_pair("hf_accelerate.py", dataset, str(tmp_path))
    assert_bit_exact_resume(ref, crashed)
    assert_crash_reported(crashed)
