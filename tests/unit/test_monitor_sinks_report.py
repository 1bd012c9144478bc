"""One run with every sink on (ledger, MLflow on its SQLite store, the rich console
rendering off-screen), a crash and a resume; then MLflow read back through MlflowClient,
and the report rendered from the run's ledger, through the library and the CLI.

The run's records are synthetic (``steadytrain.testing.synthetic``): explicit per-step
durations and a data stall, fed through real meters, so what the sinks and the report show
does not depend on how fast this machine runs a sleep. The meter's own measuring path
(``meter.step``) has its test at the end."""

from __future__ import annotations

import json
import shutil

import pytest

from steadytrain.cli import main
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.sinks import offscreen_console
from steadytrain.report.build import build_report
from steadytrain.testing.synthetic import Timeline, feed

CFG = AlertConfig(window=6, warmup=2, baseline=8, band_tolerance=0.5, max_recovery_age_s=None)
STALL_S = 0.03  # the data source stalls from step 28 of the second attempt on
EVAL_S = 0.05  # an evaluation before steps 15 and 35 (the ``eval`` phase): its own bucket


def _attempt(tl: Timeline, steps, restored: int, stall_from: int | None = None) -> None:
    tl.job_start(restored_step=restored, startup_s=0.05, restore_s=0.01 if restored else 0.0)
    for step in steps:
        stalled = stall_from is not None and step >= stall_from
        tl.step(
            step,
            tokens=8 * 32,
            data_wait_s=0.0002 + (STALL_S if stalled else 0.0),
            compute_s=0.006 + 0.0001 * (step % 3),  # a little jitter
            other_s=0.0003,
            eval_s=EVAL_S if step % 20 == 15 else 0.0,
            loss=1.0 / step,
            cache_misses=0,
            read_p99_s=0.001,
            rss_bytes=500 << 20,
            shm_bytes=0,
        )
        if step % 10 == 0:  # an async save commits: it blocked nothing
            tl.event(
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


def _meter(run_dir, console) -> GoodputMeter:
    return GoodputMeter(
        run_dir,
        expected_tokens_per_s=None,
        sinks=("jsonl", "mlflow", "console"),
        alert_config=CFG,
        console=console,
        total_steps=40,
        sink_options={"every_s": 0.0, "window_s": 0.0, "flush_s": 0.2},
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    console = offscreen_console()
    # Attempt 0 runs 1..24 and "crashes"; 0.5 s later attempt 1 resumes from step 20
    # (redoes 21..24) and hits a data stall from step 28 on. One clock for both.
    tl = Timeline()
    _attempt(tl, range(1, 25), 0)
    crashed_at = len(tl.records)
    tl.advance(0.5)
    _attempt(tl, range(21, 41), 20, stall_from=28)
    records = tl.anchored()
    first = _meter(run_dir, console)
    feed(first, records[:crashed_at], batch=1)
    # A crashed process writes no job_end; stop the writer the way a crash would leave
    # the file (everything flushed so far is on disk).
    first._closed = True
    first._writer.close()
    meter = _meter(run_dir, console)
    feed(meter, records[crashed_at:], batch=1)
    meter.close()
    yield {"dir": run_dir, "meter": meter, "console": console}
    shutil.rmtree(run_dir, ignore_errors=True)


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
    evals = {m.step: m.value for m in client.get_metric_history(run_id, "eval_s")}
    assert {k for k, v in evals.items() if v} == {15, 35}
    assert evals[15] == pytest.approx(EVAL_S) and evals[35] == pytest.approx(EVAL_S)
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
    b = run["meter"].breakdown()
    assert b.steps_lost == 4 and b.steps_kept == 40


def test_report_renders_from_the_run(run, tmp_path):
    s = build_report(run["dir"], tmp_path / "rep")
    assert 0 < s["goodput"] < 1
    assert s["attempts"] == 2 and s["steps_lost"] == 4
    assert s["badput_s"]["lost_to_failures"] > 0 and s["badput_s"]["data_wait"] > 0
    # The evaluations are their own bucket, in the breakdown and on the goodput bar.
    assert s["badput_s"]["eval"] == pytest.approx(2 * EVAL_S)
    assert s["plotted"]["goodput"]["segments"]["eval"] == pytest.approx(s["badput"]["eval"])
    # one rank: no straggler incident; the live alert (rank 0's own ledger) is kept
    assert any(i["diagnosis"] == "data loading" for i in s["alerts"])
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
    # No PNGs: the JSON's keys and the text's eval line are read (the CLI's pictures:
    # test_hostile_records::test_cli_report_json_over_every_bad_line).
    assert main(["report", str(run["dir"]), "--out", str(tmp_path), "--json", "--no-plots"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"goodput", "badput", "badput_s", "incidents", "alerts", "plots", "html"} <= set(out)
    assert set(out["badput"]) >= {
        "startup",
        "restore",
        "data_wait",
        "checkpoint_block",
        "eval",
        "lost_to_failures",
        "restart_gap",
        "other",
    }
    assert out["html"].endswith("report.html")
    assert main(["report", str(run["dir"]), "--out", str(tmp_path), "--no-plots"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["eval"])
    assert float(line.split("(")[1].split()[0]) == pytest.approx(2 * EVAL_S, abs=0.05)


def test_report_cli_missing_ledger_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "ledger.jsonl" in capsys.readouterr().err


def test_meter_step_measures_the_step_and_samples_memory(tmp_path):
    """The training loop's path: ``step_s`` is measured between calls (never less than what
    the loop reported inside it), RSS and /dev/shm are sampled every ``memory_every``."""
    with GoodputMeter(tmp_path, memory_every=2) as m:
        m.job_start()
        for step in range(1, 6):
            m.step(step, tokens=8, data_wait_s=0.0, compute_s=0.0)
    steps = [r for r in read_ledger(tmp_path) if r["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert ["rss_bytes" in s for s in steps] == [True, False, True, False, True]
    assert all(s["rss_bytes"] > 0 and s["shm_bytes"] >= 0 for s in steps if "rss_bytes" in s)
    assert all(s["step_s"] >= 0 for s in steps)
