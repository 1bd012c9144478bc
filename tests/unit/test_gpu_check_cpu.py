"""bench/gpu_check.py on a machine without CUDA: every part skips, it says so, exits 0 and
records nothing (a CPU run must never overwrite a GPU result)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from steadytrain.testing import forkserver

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_check.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_on_cpu_reports_cuda_false(tmp_path):
    out = tmp_path / "gpu_check.json"
    # Forked from the fork server (torch imported once per test process): nothing here is
    # about the script's start-up.
    proc = forkserver.run([sys.executable, SCRIPT, "--out", str(out)], timeout=100)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cuda"] is False
    for part in ("nccl_resume", "bf16_autocast", "staging", "loader_pin_memory"):
        assert "CUDA is not available" in report[part]["skipped"], part
    assert not out.exists()
