"""The MLflow sink: goodput metrics into an MLflow run, one run for every attempt of a job.

Kept apart from ``sinks`` (the writer thread and the light sinks) because it is the one sink
with its own aggregation rules and an optional heavy dependency (``mlflow`` is imported only
when the sink is opened, on the meter's background thread).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from steadytrain.extras import require
from steadytrain.storage.publish import publish_bytes

__all__ = ["MlflowSink"]


class MlflowSink:
    """MLflow through ``MlflowClient`` (no global active run; safe from a thread).

    Default store: ``sqlite:///RUN_DIR/mlflow.db``. The MLflow run id is kept in
    ``RUN_DIR/mlflow_run.json`` so every attempt of a job logs into the same MLflow run.
    Per step (or, when steps are faster than ``every_s``, one point per ``every_s`` holding
    the mean per step; ``checkpoint_block_s`` summed): ``loss``, ``tokens_per_s``,
    ``fetch_seconds``, ``checkpoint_block_s``, ``step_s``, ``compute_s``, ``rss_bytes``,
    ``shm_bytes``, ``goodput`` (the run's goodput so far, all attempts); every
    ``window_s``: the Databricks DataLoader names ``dataloader/fetch_seconds/rank_{R}`` and
    ``dataloader/between_next_seconds/rank_{R}`` (window means) with ``..._variance``
    companions; alerts as tags ``alert.<step>.<kind>``.
    """

    name = "mlflow"
    STEP_METRICS = {
        "loss": "loss",
        "data_wait_s": "fetch_seconds",
        "checkpoint_block_s": "checkpoint_block_s",
        "step_s": "step_s",
        "compute_s": "compute_s",
        "rss_bytes": "rss_bytes",
        "shm_bytes": "shm_bytes",
    }

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        tracking_uri: str | None = None,
        experiment: str = "steadytrain",
        run_name: str | None = None,
        rank: int = 0,
        every_s: float = 0.5,
        window_s: float = 10.0,
        flush_s: float = 5.0,
        **_: Any,
    ) -> None:
        require("mlflow", "the MLflow sink")
        require("sqlalchemy", "MLflow's SQLite store")
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir)
        self.uri = tracking_uri or f"sqlite:///{self.run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.rank = rank
        self.every_s = every_s
        self.window_s = window_s
        self.flush_s = flush_s
        self._status = RunStatus
        self.run_id = self._open_run(experiment, run_name or self.run_dir.name)
        self._metrics: list[Any] = []
        self._tags: dict[str, str] = {}
        self._last_flush = time.monotonic()
        self._win = [0, 0.0, 0.0, 0.0, 0.0]  # n, fetch sum, fetch sq, between sum, between sq
        self._win_start = time.monotonic()
        self._last_step = 0
        self._agg: dict[str, Any] = {"n": 0}
        self._emit_t = 0.0
        self._live: dict[str, Any] = {}

    def _open_run(self, experiment: str, run_name: str) -> str:
        marker = self.run_dir / "mlflow_run.json"
        if marker.exists():
            saved = json.loads(marker.read_text())
            if saved.get("tracking_uri") == self.uri:
                self.client.update_run(saved["run_id"], status="RUNNING")
                return str(saved["run_id"])
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=run_name)
        record = {"run_id": run.info.run_id, "tracking_uri": self.uri}
        publish_bytes(str(marker), json.dumps(record))  # every attempt finds the same run
        return str(run.info.run_id)

    def write(self, records: list[dict[str, Any]], live: dict[str, Any]) -> None:
        for r in records:
            kind = r.get("type")
            if kind == "step":
                self._add_step(r)
                if r["t"] - self._emit_t >= self.every_s:
                    self._emit(live)
            elif kind == "alert":
                key = f"alert.{r.get('step')}.{r.get('kind')}"
                self._tags[key] = json.dumps(
                    {k: r.get(k) for k in ("message", "diagnosis", "next")}
                )[:5000]
            elif kind == "job_start":
                key = f"attempt.{r.get('attempt')}.restored_step"
                self._tags[key] = str(r.get("restored_step"))
        self._live = live
        self._maybe_window(int(time.time() * 1000))
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def _add_step(self, r: dict[str, Any]) -> None:
        a = self._agg
        a["n"] += 1
        a["step"] = int(r.get("step", 0))
        a["t"] = r["t"]
        for key in ("loss", "data_wait_s", "checkpoint_block_s", "step_s", "compute_s"):
            v = r.get(key)
            if v is not None:
                a[key] = a.get(key, 0.0) + float(v)
                a[key + "#n"] = a.get(key + "#n", 0) + 1
        a["tokens"] = a.get("tokens", 0) + int(r.get("tokens") or 0)
        for key in ("rss_bytes", "shm_bytes"):
            if r.get(key) is not None:
                a[key] = float(r[key])  # a level, not a rate: the latest sample
        fetch = float(r.get("data_wait_s") or 0.0)
        between = max(0.0, float(r.get("step_s") or 0.0) - fetch)
        w = self._win
        w[0] += 1
        w[1] += fetch
        w[2] += fetch * fetch
        w[3] += between
        w[4] += between * between

    def _emit(self, live: dict[str, Any]) -> None:
        """One point per metric for the steps since the last point (every step when steps
        are slower than ``every_s``): means per step, ``checkpoint_block_s`` summed."""
        from mlflow.entities import Metric

        a = self._agg
        if not a["n"]:
            return
        ts, step = int(a["t"] * 1000), a["step"]
        self._last_step = step
        self._emit_t = a["t"]
        out = self._metrics
        for key, name in self.STEP_METRICS.items():
            if key in ("rss_bytes", "shm_bytes"):
                if key in a:
                    out.append(Metric(name, a[key], ts, step))
            elif key in a:
                value = a[key] if key == "checkpoint_block_s" else a[key] / a[key + "#n"]
                out.append(Metric(name, value, ts, step))
        if a.get("step_s"):
            out.append(Metric("tokens_per_s", a["tokens"] / a["step_s"], ts, step))
        if live.get("goodput") is not None:
            out.append(Metric("goodput", float(live["goodput"]), ts, step))
        self._agg = {"n": 0}

    def _maybe_window(self, ms: int, force: bool = False) -> None:
        from mlflow.entities import Metric

        n = self._win[0]
        if n == 0 or (not force and time.monotonic() - self._win_start < self.window_s):
            return
        _, fs, fq, bs, bq = self._win
        for name, s, q in (("fetch_seconds", fs, fq), ("between_next_seconds", bs, bq)):
            mean = s / n
            var = max(0.0, q / n - mean * mean)
            step = self._last_step
            self._metrics.append(Metric(f"dataloader/{name}/rank_{self.rank}", mean, ms, step))
            self._metrics.append(
                Metric(f"dataloader/{name}_variance/rank_{self.rank}", var, ms, step)
            )
        self._win = [0, 0.0, 0.0, 0.0, 0.0]
        self._win_start = time.monotonic()

    def tick(self, live: dict[str, Any]) -> None:
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        from mlflow.entities import RunTag

        self._last_flush = time.monotonic()
        metrics, self._metrics = self._metrics, []
        tags, self._tags = self._tags, {}
        tag_list = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(metrics), 1), 1000):  # log_batch takes at most 1000 metrics
            chunk = metrics[i : i + 1000]
            if chunk or (i == 0 and tag_list):
                self.client.log_batch(self.run_id, metrics=chunk, tags=tag_list if i == 0 else [])

    def close(self, reason: str = "finished") -> None:
        self._emit(self._live)
        self._maybe_window(int(time.time() * 1000), force=True)
        self.flush()
        status = "FINISHED" if reason == "finished" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)
