"""The MLflow sink: goodput metrics into an MLflow run, one run for every attempt of a job.

Kept apart from ``sinks`` (the writer thread and the light sinks) because it is the one sink
with its own aggregation rules and an optional heavy dependency (``mlflow`` is imported only
when the sink is opened, on the meter's background thread; ``mlflow_missing`` checks it is
there without importing it).

The run's config (the ``job_start`` record's) is logged as params with flattened keys
(``data.seq_len``), through ``steadytrain.redact`` first: credentials never reach MLflow.

Creating an MLflow SQLite store runs every schema migration: ~5-10 s of CPU on rank 0 at
the start of each run (measured on a 2-core machine). The first store a machine makes is
kept as an empty template (``~/.cache/steadytrain/mlflow-VERSION-empty.db``, one per MLflow
version) and later runs start from a copy of it in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from steadytrain.extras import missing_extra, require
from steadytrain.redact import redact, redact_text
from steadytrain.storage.publish import publish_bytes, publish_file, temp_name

__all__ = ["MlflowSink", "mlflow_missing", "flatten_params", "UI_PACKAGE", "ui_command"]

log = logging.getLogger("steadytrain.monitor")

# mlflow-skinny (the [mlflow] extra) logs and reads runs but has no UI server.
UI_PACKAGE = "mlflow"


def ui_command(run_dir: str | os.PathLike[str]) -> str:
    """The one command that opens a run's default store in the MLflow UI (after
    ``pip install mlflow``; ``mlflow ui`` is ``mlflow server``, default port 5000)."""
    return f"mlflow ui --backend-store-uri sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def mlflow_missing(tracking_uri: str | None = None) -> str | None:
    """Why the MLflow sink cannot start here (the missing package and the ``pip install``
    line), or None. Looks the packages up without importing them (``import mlflow`` costs
    about a second); SQLAlchemy and Alembic are needed only for a SQLite store."""
    needed = ["mlflow"]
    if not tracking_uri or tracking_uri.startswith("sqlite:"):
        needed += ["sqlalchemy", "alembic"]
    for module in needed:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-imported package
            found = False
        if not found:
            return str(missing_extra(module, "MLflow tracking (monitor.sinks)"))
    return None


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"data": {"seq_len": 128}}`` -> ``{"data.seq_len": "128"}`` (redacted, as MLflow
    params: text, at most 6000 characters; lists and empty tables as JSON)."""
    out: dict[str, str] = {}
    for key, value in redact(config).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name[:250]] = text[:6000]
    return out


def _default_store(run_dir: Path) -> str:
    """``sqlite:///RUN_DIR/mlflow.db``, started from the empty template when there is none."""
    db = run_dir.resolve() / "mlflow.db"
    if not db.exists():
        try:
            _copy_template(db)
        except Exception as exc:  # no cache directory, a full disk: MLflow makes it itself
            log.warning("MLflow store template unusable (%s); creating %s from scratch", exc, db)
    return f"sqlite:///{db}"


def _copy_template(db: Path) -> None:
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steadytrain"
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if not template.exists():
        from mlflow.tracking import MlflowClient

        cache.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(str(template))
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # migrates
        publish_file(tmp, str(template), durable=False)  # every writer makes the same file
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(str(db))
    shutil.copyfile(template, tmp)
    publish_file(tmp, str(db), durable=False)


class MlflowSink:
    """MLflow through ``MlflowClient`` (no global active run; safe from a thread).

    Default store: ``sqlite:///RUN_DIR/mlflow.db``. The MLflow run id is kept in
    ``RUN_DIR/mlflow_run.json`` so every attempt of a job logs into the same MLflow run.
    Per step (or, when steps are faster than ``every_s``, one point per ``every_s`` holding
    the mean per step; ``checkpoint_block_s`` and ``eval_s`` summed): ``loss``,
    ``tokens_per_s``, ``fetch_seconds``, ``checkpoint_block_s``, ``eval_s`` (the seconds
    spent evaluating: the ``eval`` bucket), ``step_s``, ``compute_s``, ``rss_bytes``,
    ``shm_bytes``, ``goodput`` (the run's goodput so far, all attempts); every
    ``window_s``: the Databricks DataLoader names ``dataloader/fetch_seconds/rank_{R}`` and
    ``dataloader/between_next_seconds/rank_{R}`` (window means) with ``..._variance``
    companions; alerts as tags ``alert.<step>.<kind>``; the config as params (redacted;
    a value changed by a later attempt is a tag ``attempt.<n>.param.<key>``, since MLflow
    params cannot change). ``close`` flushes the last partial point and window.

    ``log_rank_windows(rows)`` logs window rows measured on other ranks under the same
    names; with ``own_rank_windows=False`` (a ``sink_options`` entry) the sink leaves its
    own rank's window to those rows.
    """

    name = "mlflow"
    STEP_METRICS = {
        "loss": "loss",
        "data_wait_s": "fetch_seconds",
        "checkpoint_block_s": "checkpoint_block_s",
        "eval_s": "eval_s",
        "step_s": "step_s",
        "compute_s": "compute_s",
        "rss_bytes": "rss_bytes",
        "shm_bytes": "shm_bytes",
    }
    SUMMED = ("checkpoint_block_s", "eval_s")

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
        own_rank_windows: bool = True,
        **_: Any,
    ) -> None:
        require("mlflow", "the MLflow sink")
        require("sqlalchemy", "MLflow's SQLite store")
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir)
        self.uri = tracking_uri or _default_store(self.run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.rank = rank
        self.every_s = every_s
        self.window_s = window_s
        self.flush_s = flush_s
        self.own_rank_windows = own_rank_windows
        self._status = RunStatus
        self._params: dict[str, str] = {}  # what the run holds (params are write-once)
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
            if saved.get("tracking_uri") == redact_text(self.uri):
                self.client.update_run(saved["run_id"], status="RUNNING")
                self._params = dict(self.client.get_run(saved["run_id"]).data.params)
                return str(saved["run_id"])
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=run_name)
        # The URI as shown (a server URI may hold user:password@): compared, never used.
        record = {"run_id": run.info.run_id, "tracking_uri": redact_text(self.uri)}
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
                if isinstance(r.get("config"), dict):
                    self._log_params(r["config"], r.get("attempt"))
        self._live = live
        self._maybe_window(int(time.time() * 1000))
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def _log_params(self, config: dict[str, Any], attempt: Any) -> None:
        """New keys become params now; a key whose value changed since an earlier attempt
        becomes a tag (MLflow refuses to change a param)."""
        from mlflow.entities import Param

        new: list[Any] = []
        for key, value in flatten_params(config).items():
            if key not in self._params:
                new.append(Param(key, value))
                self._params[key] = value
            elif self._params[key] != value:
                self._tags[f"attempt.{attempt}.param.{key}"[:250]] = value
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def log_rank_windows(self, rows: list[dict[str, Any]]) -> None:
        """Log window means measured on any rank under the Databricks DataLoader names.

        Each row: ``{"rank", "step", "fetch_seconds", "between_next_seconds",
        "fetch_seconds_variance", "between_next_seconds_variance"}`` and optionally ``"t"``
        (wall time of the window's end; default now); a missing or None value is skipped.
        Queued like every other metric: sent at the next flush (every ``flush_s``) or at
        ``close``. Call it from the thread that calls ``write`` (the meter's writer).
        """
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        for row in rows:
            rank, step = int(row["rank"]), int(row.get("step") or 0)
            ms = int(float(row["t"]) * 1000) if row.get("t") is not None else now_ms
            for name in ("fetch_seconds", "between_next_seconds"):
                for key in (name, f"{name}_variance"):
                    if row.get(key) is not None:
                        metric = f"dataloader/{key}/rank_{rank}"
                        self._metrics.append(Metric(metric, float(row[key]), ms, step))

    def _add_step(self, r: dict[str, Any]) -> None:
        a = self._agg
        a["n"] += 1
        a["step"] = int(r.get("step", 0))
        a["t"] = r["t"]
        for key in ("loss", "data_wait_s", "checkpoint_block_s", "eval_s", "step_s", "compute_s"):
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
                summed = key in self.SUMMED  # occasional events: the point's total
                value = a[key] if summed else a[key] / a[key + "#n"]
                out.append(Metric(name, value, ts, step))
        if a.get("step_s"):
            out.append(Metric("tokens_per_s", a["tokens"] / a["step_s"], ts, step))
        if live.get("goodput") is not None:
            out.append(Metric("goodput", float(live["goodput"]), ts, step))
        self._agg = {"n": 0}

    def _maybe_window(self, ms: int, force: bool = False) -> None:
        from mlflow.entities import Metric

        n = self._win[0]
        if (
            not self.own_rank_windows
            or n == 0
            or (not force and time.monotonic() - self._win_start < self.window_s)
        ):
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
