"""One real run with every sink on (ledger, MLflow on its SQLite store, the rich console
rendering off-screen), a crash and a resume; then MLflow read back through MlflowClient,
and the report rendered from the run's ledger, through the library and the CLI."""

from __future__ import annotations

import json
import time

import pytest
import torch

from steadytrain.cli import main
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.report import build_report
from steadytrain.monitor.sinks import offscreen_console

CFG = AlertConfig(window=6, warmup=2, baseline=8, band_tolerance=0.5, max_recovery_age_s=None)


def _attempt(run_dir, steps, restored, console, stall_from=None, crash=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    meter = GoodputMeter(
        run_dir,
        expected_tokens_per_s=None,
        sinks=("jsonl", "mlflow", "console"),
        alert_config=CFG,
        console=console,
        total_steps=40,
        sink_options={"every_s": 0.0, "window_s": 0.0, "flush_s": 0.2},
    )
    meter.job_start(restored_step=restored, startup_s=0.05, restore_s=0.01 if restored else 0.0)
    for step in steps:
        t0 = time.perf_counter()
        if stall_from is not None and step >= stall_from:
            time.sleep(0.03)  # the data source stalls
        x = torch.randn(8, 32)
        t1 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.006)
        t2 = time.perf_counter()
        meter.step(
            step,
            tokens=8 * 32,
            data_wait_s=t1 - t0,
            compute_s=t2 - t1,
            loss=loss.detach(),
            cache_misses=0,
            read_p99_s=0.001,
        )
        if step % 10 == 0:
            meter.event(
                {
                    "type": "checkpoint",
                    "step": step,
                    "block_s": 0.0,
                    "durable_s": 0.01,
                    "ok": True,
                    "path": f"ckpt/step-{step}",
                    "error": None,
                }
            )
    if crash:
        meter.flush()
        # A crashed process writes no job_end; stop the writer the way a crash would
        # leave the file (everything flushed so far is on disk).
        meter._closed = True
        meter._writer.close()
        return meter
    meter.close()
    return meter


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    console = offscreen_console()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Attempt 0 runs 1..24 and "crashes"; attempt 1 resumes from step 20 (redoes 21..24)
        # and hits a data stall from step 28 on.
        _attempt(run_dir, range(1, 25), 0, console, crash=True)
        meter = _attempt(run_dir, range(21, 41), 20, console, stall_from=28)
    finally:
        torch.set_num_threads(threads)
    return {"dir": run_dir, "meter": meter, "console": console}


def _mlflow(run_dir):
    from mlflow.tracking import MlflowClient

    info = json.loads((run_dir / "mlflow_run.json").read_text())
    return MlflowClient(tracking_uri=info["tracking_uri"]), info["run_id"]


def test_mlflow_metrics_read_back_from_sqlite(run):
    client, run_id = _mlflow(run["dir"])
    assert client._tracking_client.tracking_uri.startswith("sqlite:///")
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    steps = [x for x in read_ledger(run["dir"]) if x["type"] == "step"]
    losses = client.get_metric_history(run_id, "loss")
    # Both attempts log into the same MLflow run: 24 + 20 step records.
    assert len(losses) == len(steps) == 44
    by_step = {(m.step, round(m.value, 6)) for m in losses}
    assert {(s["step"], round(s["loss"], 6)) for s in steps} == by_step
    fetch = {m.step: m.value for m in client.get_metric_history(run_id, "fetch_seconds")}
    last = steps[-1]
    assert fetch[last["step"]] == pytest.approx(last["data_wait_s"])
    tps = client.get_metric_history(run_id, "tokens_per_s")
    assert len(tps) == 44 and all(m.value > 0 for m in tps)
    assert len(client.get_metric_history(run_id, "checkpoint_block_s")) == 44
    gp = client.get_metric_history(run_id, "goodput")
    assert gp and all(0 < m.value <= 1 for m in gp)
    db = client.get_metric_history(run_id, "dataloader/fetch_seconds/rank_0")
    assert db and max(m.value for m in db) >= 0.02  # the stall shows in the window means
    assert client.get_metric_history(run_id, "dataloader/between_next_seconds/rank_0")
    assert client.get_metric_history(run_id, "dataloader/fetch_seconds_variance/rank_0")
    alert_tags = {k: json.loads(v) for k, v in r.data.tags.items() if k.startswith("alert.")}
    assert any(
        k.endswith(".data_wait_share") and v["diagnosis"] == "data loading"
        for k, v in alert_tags.items()
    )
    assert r.data.tags["attempt.1.restored_step"] == "20"


def test_console_view_rendered(run):
    out = run["console"].file.getvalue()
    assert "tokens/s" in out and "goodput" in out and "40 / 40" in out
    assert "alert" in out and "data loading" in out  # the latest alert and its diagnosis


def test_ledger_and_live_goodput_agree(run):
    recs = read_ledger(run["dir"])
    starts = [r for r in recs if r["type"] == "job_start"]
    assert [s["attempt"] for s in starts] == [0, 1]
    assert all("rss_bytes" in r and "shm_bytes" in r for r in recs if r["type"] == "step")
    b = run["meter"].breakdown()
    assert b.steps_lost == 4 and b.steps_kept == 40


def test_report_renders_from_the_run(run, tmp_path):
    s = build_report(run["dir"], tmp_path / "rep")
    assert 0 < s["goodput"] < 1
    assert s["attempts"] == 2 and s["steps_lost"] == 4
    assert s["badput_s"]["lost_to_failures"] > 0 and s["badput_s"]["data_wait"] > 0
    assert any(i["diagnosis"] == "data loading" for i in s["incidents"])
    html = (tmp_path / "rep" / "report.html").read_text()
    for key, path in s["plots"].items():
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n", key
        assert (tmp_path / "rep" / f"{key}.png").stat().st_size > 5000
        assert f'href="{key}.png"' in html and "data:image/png;base64," in html
    assert "data loading" in html
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["goodput"] == s["goodput"]


def test_report_cli_json(run, tmp_path, capsys):
    assert main(["report", str(run["dir"]), "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"goodput", "badput", "badput_s", "incidents", "plots", "html"} <= set(out)
    assert set(out["badput"]) >= {
        "startup",
        "restore",
        "data_wait",
        "checkpoint_block",
        "lost_to_failures",
        "restart_gap",
        "other",
    }
    assert out["html"].endswith("report.html")


def test_report_cli_missing_ledger_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "ledger.jsonl" in capsys.readouterr().err
