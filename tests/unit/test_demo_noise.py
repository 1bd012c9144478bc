"""What a new user sees must not mislead (issue 12, item 13, "demo noise"): the demo does not
warn about its own corpus, advice fits the device, tiny plan intervals are not "0.0 min",
and the report's heading, bands and incident labels agree with the incidents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadytrain.cli import main
from steadytrain.data.ingest.corpus import stdlib_corpus_paths
from steadytrain.data.ingest.tokenize import tokenize
from steadytrain.demo import run_demo
from steadytrain.monitor.alerts import AlertConfig, AlertEngine
from steadytrain.monitor.ledger import Ledger, read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.report.build import build_report, goodput_class
from steadytrain.testing.synthetic import Timeline

pytestmark = pytest.mark.timeout(180)

CFG = AlertConfig(window=6, warmup=2, baseline=8, band_tolerance=0.3, max_recovery_age_s=None)


# -- the demo's own corpus -----------------------------------------------------------------


def test_demo_summarises_its_own_non_utf8_files_instead_of_warning(tmp_path) -> None:
    warnings: list[str] = []
    lines: list[str] = []
    summary = run_demo(
        str(tmp_path / "demo"), train=False, warn=warnings.append, out=lines.append, workers=1
    )
    replaced = summary["dataset"]["replaced_files"]
    if not replaced:
        pytest.skip("this Python's standard library has no non-UTF-8 test files")
    assert warnings == []  # nothing about the bundled corpus is a warning
    said = [line for line in lines if "not UTF-8" in line]
    assert len(said) == 1 and f"{replaced} standard-library file(s)" in said[0]
    # A user's own corpus still gets a warning that names each such file.
    bad = next(p for p in stdlib_corpus_paths() if p.endswith("module_koi8_r.py"))
    own: list[str] = []
    tokenize([bad], str(tmp_path / "own"), warn=own.append, workers=0)
    assert len(own) == 1 and bad in own[0]


# -- advice that fits the device -----------------------------------------------------------


def _compute_slowdown(device: str | None, config: dict | None = None) -> list[dict]:
    """An attempt whose step compute triples after the baseline: compute/hardware."""
    tl = Timeline(t0=1000.0)
    start = tl.job_start(startup_s=1.0)
    start["config"] = config or {}
    if device is not None:
        start["device"] = device
    for step in range(1, 41):
        tl.step(step, tokens=2048, data_wait_s=0.0005, compute_s=0.05 if step < 20 else 0.15)
    engine = AlertEngine(CFG, world_size=2)
    return [a for rec in tl.records for a in engine.observe(rec)]


def test_compute_advice_on_a_cpu_run_has_no_gpu_tools() -> None:
    (cpu,) = [a for a in _compute_slowdown("cpu") if a["kind"] == "throughput_band"]
    assert cpu["diagnosis"] == "compute/hardware"
    assert "nvidia-smi" not in cpu["next"] and "GPU" not in cpu["next"]
    assert "cores" in cpu["next"]
    assert "tokens/s per rank" in cpu["message"]
    # An explicit train.device = "cpu" in the recorded config says the same.
    config = {"train": {"device": "cpu"}}
    (cfg,) = [a for a in _compute_slowdown(None, config) if a["kind"] == "throughput_band"]
    assert "nvidia-smi" not in cfg["next"]
    (gpu,) = [a for a in _compute_slowdown("cuda") if a["kind"] == "throughput_band"]
    assert "nvidia-smi" in gpu["next"] and "tokens/s per GPU" in gpu["message"]


def test_the_meter_records_the_device_in_job_start(tmp_path) -> None:
    meter = GoodputMeter(str(tmp_path), sinks=("jsonl",), total_steps=1)
    meter.job_start(device="cpu")
    meter.close()
    (start,) = [r for r in read_ledger(tmp_path) if r["type"] == "job_start"]
    assert start["device"] == "cpu"


def test_the_band_in_an_incident_says_whether_it_was_learned() -> None:
    (alert,) = [a for a in _compute_slowdown("cpu") if a["kind"] == "throughput_band"]
    assert "this attempt's learned band (at least " in alert["message"]
    assert "inf" not in alert["message"] and "expected band" not in alert["message"]


# -- plan: tiny costs give intervals of seconds ----------------------------------------------


def test_plan_shows_a_tiny_optimal_interval_with_its_value(capsys) -> None:
    argv = ["plan", "--interruptions-per-day", "900", "--ckpt-cost", "0.03"]
    argv += ["--restart-cost", "15", "--sim-runs", "0"]
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["optimal_interval_min"]
    assert 0 < best < 0.05  # about 2.4 s
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0.0 min" not in out
    assert f"{best:.2g} min ({60 * best:.2g} s)" in out  # "0.04 min (2.4 s)"


# -- the report ------------------------------------------------------------------------------


def test_goodput_heading_is_coloured_by_thresholds() -> None:
    assert goodput_class(0.045) == "poor"
    assert goodput_class(0.75) == "fair"
    assert goodput_class(0.95) == "good"


def _two_attempt_run(run_dir: Path) -> None:
    """Attempt 0 runs fast and slows down (incident 1); attempt 1 runs at another speed and
    slows down too (incident 2): each incident names its own attempt's learned band."""
    tl = Timeline(t0=1_800_000_000.0)
    records: list[dict] = []
    engine = AlertEngine(CFG, world_size=1)
    for attempt, (compute, restored) in enumerate([(0.05, 0), (0.2, 20)]):
        start = tl.job_start(startup_s=1.0, restored_step=restored, attempt=attempt)
        start["device"] = "cpu"
        for step in range(restored + 1, restored + 41):
            slow = step - restored > 20
            tl.step(step, tokens=2048, data_wait_s=0.001, compute_s=compute * (3 if slow else 1))
        tl.advance(5.0)
    for rec in tl.records:
        records.append(rec)
        records += engine.observe(rec)
    Ledger(run_dir).write(records)


def test_report_bands_and_heading_agree_with_the_incidents(tmp_path) -> None:
    _two_attempt_run(tmp_path)
    s = build_report(tmp_path, tmp_path / "rep")
    bands = [i for i in s["alerts"] if i["kind"] == "throughput_band"]  # the live alerts
    assert len(bands) == 2
    learned = [b["band"][0] for b in s["bands_per_attempt"]]
    # Each attempt's shaded band is the one its own incident names.
    for low, incident in zip(learned, bands, strict=True):
        assert f"at least {low:,.0f})" in incident["message"]
    assert learned[0] > 2 * learned[1]  # different speeds, different bands
    assert s["bands_per_attempt"][0]["kind"] == "learned"
    html = (tmp_path / "rep" / "report.html").read_text()
    assert s["goodput"] < 0.9  # restarts and slow steps: not a green heading
    assert f'<h1>Goodput <span class="{goodput_class(s["goodput"])}">' in html
