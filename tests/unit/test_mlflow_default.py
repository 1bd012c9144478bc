"""MLflow in training: on by default, redacted params, every rank's windows, the last partial
window flushed at close, and a run that goes on (with one warning) when MLflow is missing.

Every MLflow check reads back from a real SQLite store with ``MlflowClient``."""

from __future__ import annotations

import json
import os
import sys
from html import escape as html_escape

import pytest

from steadytrain.monitor.meter import MeterConfig
from steadytrain.monitor.mlflow_sink import MlflowSink, mlflow_missing, ui_command
from steadytrain.redact import REDACTED
from steadytrain.testing import forkserver
from steadytrain.train.config import MonitorSection, load_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, make_dataset  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SECRET = "PLANTED-S3CRET-5150"
KEY_ID = "AKIAPLANTED0042"


def _client(run_dir):
    from mlflow.tracking import MlflowClient

    info = json.loads((run_dir / "mlflow_run.json").read_text())
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}"), info["run_id"]


def _history(client, run_id, name):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def _step(step, wait, step_s, t):
    return {"type": "step", "t": t, "step": step, "tokens": 100, "step_s": step_s,
            "data_wait_s": wait, "compute_s": step_s - wait, "checkpoint_block_s": 0.0}  # fmt: skip


def test_training_turns_mlflow_on_and_the_library_stays_opt_in() -> None:
    cfg = load_config("small", ["data.dataset=/data/ds"])
    assert isinstance(cfg.monitor, MonitorSection) and "mlflow" in cfg.monitor.sinks
    assert MeterConfig().sinks == ["jsonl"]  # GoodputMeter users opt in
    off = load_config("small", ["data.dataset=/data/ds", 'monitor.sinks=["jsonl"]'])
    assert off.monitor.sinks == ["jsonl"]


def test_missing_mlflow_warns_once_and_keeps_the_ledger(monkeypatch) -> None:
    said: list[str] = []
    monitor = MonitorSection()
    assert monitor.without_missing_extras(said.append) is monitor and not said  # installed
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` sees uninstalled
    assert "pip install 'steadytrain[mlflow]'" in (mlflow_missing() or "")
    usable = monitor.without_missing_extras(said.append)
    assert usable.sinks == ["jsonl"]
    assert len(said) == 1 and "pip install 'steadytrain[mlflow]'" in said[0]


def test_close_flushes_the_last_partial_window_and_params(tmp_path) -> None:
    """Nothing reaches MLflow before close (every period is far away): close sends the
    step means, the partial DataLoader window and the config."""
    sink = MlflowSink(tmp_path, every_s=1e9, window_s=1e9, flush_s=1e9)
    config = {"data": {"seq_len": 64}, "checkpoint": {"storage_options": {"secret": SECRET}}}
    sink.write([{"type": "job_start", "t": 1.0, "attempt": 0, "config": config}], {})
    waits = [0.1, 0.2, 0.6]
    sink.write([_step(i + 1, w, 1.0, 10.0 + i) for i, w in enumerate(waits)], {"goodput": 0.5})
    client, run_id = _client(tmp_path)
    assert client.get_run(run_id).data.metrics == {}  # still queued
    sink.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    mean = sum(waits) / 3
    ((step, value),) = _history(client, run_id, "dataloader/fetch_seconds/rank_0")
    assert step == 3 and value == pytest.approx(mean)
    ((_, var),) = _history(client, run_id, "dataloader/fetch_seconds_variance/rank_0")
    assert var == pytest.approx(sum((w - mean) ** 2 for w in waits) / 3)
    ((_, between),) = _history(client, run_id, "dataloader/between_next_seconds/rank_0")
    assert between == pytest.approx(1.0 - mean)
    assert _history(client, run_id, "fetch_seconds") == [(3, pytest.approx(mean))]
    params = run.data.params
    assert params["data.seq_len"] == "64"
    assert params["checkpoint.storage_options.secret"] == REDACTED


def test_log_rank_windows_and_params_across_attempts(tmp_path) -> None:
    sink = MlflowSink(tmp_path, flush_s=1e9, own_rank_windows=False)
    sink.write([{"type": "job_start", "t": 1.0, "attempt": 0, "config": {"lr": 1, "seed": 2}}], {})
    sink.write([_step(1, 0.5, 1.0, 5.0)], {})  # rank 0's own window is left to the rows
    rows = [
        {"rank": r, "step": 10, "fetch_seconds": 0.1 * (r + 1), "between_next_seconds": 0.5,
         "fetch_seconds_variance": 0.01, "between_next_seconds_variance": None}
        for r in range(3)
    ]  # fmt: skip
    sink.log_rank_windows(rows)
    sink.log_rank_windows([{**rows[2], "step": 20, "fetch_seconds": 0.9}])
    sink.close()
    # A restart: the next attempt logs into the same run; a changed value becomes a tag.
    again = MlflowSink(tmp_path, flush_s=1e9)
    assert again.run_id == sink.run_id
    again.write([{"type": "job_start", "t": 9.0, "attempt": 1, "config": {"lr": 3, "seed": 2}}], {})
    again.close()
    client, run_id = _client(tmp_path)
    for r in range(3):
        got = _history(client, run_id, f"dataloader/fetch_seconds/rank_{r}")
        want = [(10, pytest.approx(0.1 * (r + 1)))] + ([(20, pytest.approx(0.9))] if r == 2 else [])
        assert sorted(got) == want
        assert _history(client, run_id, f"dataloader/between_next_seconds/rank_{r}")[0][1] == 0.5
        assert _history(client, run_id, f"dataloader/fetch_seconds_variance/rank_{r}")
        assert not _history(client, run_id, f"dataloader/between_next_seconds_variance/rank_{r}")
    assert len(_history(client, run_id, "dataloader/fetch_seconds/rank_0")) == 1  # rows only
    data = client.get_run(run_id).data
    assert data.params == {"lr": "1", "seed": "2"}
    assert data.tags["attempt.1.param.lr"] == "3"


def _train(run_dir, dataset, *extra, driver=None):
    cmd = (
        [sys.executable, "-m", "steadytrain.cli"]
        if driver is None
        else [sys.executable, "-c", driver]
    )
    cmd += ["train", "demo"]
    for s in [
        *BASE_SETTINGS,
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        "train.max_steps=4",
        *extra,
    ]:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return forkserver.run(cmd, env=env, timeout=200)


def test_train_logs_redacted_config_to_ledger_mlflow_and_report(tmp_path) -> None:
    """A real `steadytrain train` with MLflow on (the demo config's default) and a secret
    planted in the checkpoint storage options: the ledger, the MLflow params (SQLite store),
    the report (JSON and HTML), every file of the run and the output hold no secret."""
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run = tmp_path / "run"
    res = _train(
        run,
        ds,
        'monitor.sinks=["jsonl", "mlflow"]',  # BASE_SETTINGS turns it off for other tests
        f"checkpoint.storage_options.key={KEY_ID}",
        f"checkpoint.storage_options.secret={SECRET}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    starts = [json.loads(line) for line in open(run / "ledger.jsonl") if '"job_start"' in line]
    opts = starts[-1]["config"]["checkpoint"]["storage_options"]
    assert opts == {"key": REDACTED, "secret": REDACTED}
    client, run_id = _client(run)
    params = client.get_run(run_id).data.params
    assert params["data.seq_len"] == "64" and params["train.max_steps"] == "4"
    assert params["checkpoint.storage_options.secret"] == REDACTED
    assert _history(client, run_id, "dataloader/fetch_seconds/rank_0")  # the Databricks name
    rep = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "report", str(run), "--json"], timeout=120
    )
    assert rep.returncode == 0, rep.stderr[-2000:]
    summary = json.loads(rep.stdout)
    assert summary["config"]["checkpoint"]["storage_options"]["secret"] == REDACTED
    html = open(summary["html"], encoding="utf-8").read()
    assert "storage_options" in html and html_escape(REDACTED) in html
    for text in (res.stdout, res.stderr, rep.stdout, rep.stderr):
        assert SECRET not in text and KEY_ID not in text
    for root, _dirs, files in os.walk(run):  # every byte the run wrote, mlflow.db included
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                blob = f.read()
            assert SECRET.encode() not in blob and KEY_ID.encode() not in blob, name


MISSING_MLFLOW = """
import sys
sys.modules["mlflow"] = None  # what an install without the [mlflow] extra looks like
from steadytrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_train_without_mlflow_warns_once_and_runs(tmp_path) -> None:
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run = tmp_path / "run"
    res = _train(run, ds, 'monitor.sinks=["jsonl", "mlflow"]', driver=MISSING_MLFLOW)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("pip install 'steadytrain[mlflow]'") == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert (run / "ledger.jsonl").exists() and not (run / "mlflow.db").exists()
    assert json.loads((run / "final.json").read_text())["step"] == 4


def test_ui_command_names_the_run_store(tmp_path) -> None:
    assert ui_command(tmp_path) == (
        f"mlflow ui --backend-store-uri sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    )
