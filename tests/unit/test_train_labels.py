"""The reference loop with ``data.labels="same"`` trains on next-token targets.

With ``"same"`` the loader hands out labels equal to the inputs and the loop must shift them
(the reference GPT does not shift inside). Wrongly handled, the model would learn to copy
its input (no shift) or to predict token t+2 (shifted twice), and the loss would still go
down. So this records what the model's ``forward`` actually receives, in a real
``steadytrain train`` process for each convention on the same data and seed, and compares
the targets position by position: equal to ``"next"``'s everywhere but the last position,
which ``"same"`` cannot know (the token after the window) and ignores (-100).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from steadytrain.testing import forkserver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, effective, make_dataset, read_trace  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# Runs `steadytrain train` in this process with GPT.forward wrapped to keep every
# (input_ids, labels) pair it is given, then saves them: the loop's own tensors, no copy of
# its logic here.
DRIVER = """
import sys, numpy as np
from steadytrain.train import model
seen = []
forward = model.GPT.forward
def recording(self, input_ids, labels=None):
    seen.append((input_ids.numpy().copy(), labels.numpy().copy()))
    return forward(self, input_ids, labels)
model.GPT.forward = recording
from steadytrain.cli import main
rc = main(sys.argv[2:])
np.savez(sys.argv[1], x=np.stack([s[0] for s in seen]), y=np.stack([s[1] for s in seen]))
sys.exit(rc)
"""


def _train(tmp_path, dataset: str, labels: str) -> tuple[np.ndarray, np.ndarray, list[float]]:
    run = str(tmp_path / labels)
    out = str(tmp_path / f"{labels}.npz")
    settings = [*BASE_SETTINGS, f"run_dir={run}", f"data.dataset={dataset}", "train.max_steps=2"]
    cmd = [sys.executable, "-c", DRIVER, out, "train", "demo", "--set", f"data.labels={labels}"]
    for s in settings:
        cmd += ["--set", s]
    env = dict(os.environ, STEADYTRAIN_FAULTS="", OMP_NUM_THREADS="1")
    res = forkserver.run(cmd, env=env, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(out) as z:
        x, y = z["x"], z["y"]
    steps = effective(read_trace(run))
    return x, y, [steps[s]["loss"] for s in sorted(steps)]


def test_labels_same_trains_on_next_token_targets(tmp_path):
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    x_next, y_next, loss_next = _train(tmp_path, ds, "next")
    x_same, y_same, loss_same = _train(tmp_path, ds, "same")
    # 2 steps x 4 micro-batches of 2 x 64 tokens, identical inputs in both runs.
    assert x_next.shape == (8, 2, 64) and np.array_equal(x_same, x_next)
    assert np.array_equal(y_next[..., :-1], x_next[..., 1:])  # "next": the following token
    assert np.array_equal(y_same[..., :-1], y_next[..., :-1])  # the loop shifted "same"
    assert np.all(y_same[..., -1] == -100)  # and ignores the one target it cannot know
    # Losses differ only by that last position's term (1 of 64): close, not equal.
    assert len(loss_same) == len(loss_next) == 2
    assert loss_same == pytest.approx(loss_next, rel=0.01), json.dumps([loss_same, loss_next])
