"""Training configuration: the components' own configs, composed; a TOML file; ``--set``.

The ``[data]``, ``[checkpoint]`` and ``[monitor]`` tables are the configs the components
own -- ``LoaderConfig`` (plus where the data is), ``CheckpointerConfig`` (plus where the
checkpoints go and which engine), ``MeterConfig`` (with ``[monitor.alerts]``:
``AlertConfig``; training turns MLflow on by default) -- so each default and each check exists once, in the component, and the
loop hands the table to the component as it is (``TokenLoader(ds, config=cfg.data, ...)``).
``[model]``, ``[optim]``, ``[train]`` and ``[faults]`` belong to the reference loop itself.

This module is only the thin layer around them: read TOML and apply ``--set key=value``
(``load_config(path, ["optim.lr=3e-4", "monitor.alerts.window=50"])``);
``settings.from_table`` coerces each value to its field's declared type and names the
section in errors. Everything is validated before any process group, dataset or
checkpoint is touched. Storage retries are set per environment instead
(``STEADYTRAIN_STORAGE_*``, ``storage/retry.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

from steadytrain.checkpoint.checkpointer import CheckpointerConfig
from steadytrain.data.read.loader import LoaderConfig
from steadytrain.errors import ConfigError
from steadytrain.monitor.meter import MeterConfig
from steadytrain.monitor.mlflow_sink import mlflow_missing
from steadytrain.run_inplace import RecoveryConfig
from steadytrain.settings import Text, check, check_choices, coerce, from_table, read_toml

__all__ = [
    "DataSection",
    "ModelConfig",
    "OptimConfig",
    "TrainLoopConfig",
    "CheckpointSection",
    "MonitorSection",
    "FaultConfig",
    "Config",
    "load_config",
    "apply_overrides",
    "coerce",
    "config_from_dict",
    "resolve_config_path",
]


@dataclasses.dataclass(kw_only=True)
class DataSection(LoaderConfig):
    """``[data]``: the loader's own settings (``LoaderConfig``) plus where the data is."""

    # One local path or URL (s3://bucket/prefix), or a list of them blended by `weights`.
    dataset: str | list[str] = ""
    cache_dir: str = ""  # node-local cache; required when the dataset is remote
    preflight: bool = True  # check every shard is reachable before the first step
    prefetch_steps: int = 64  # remote data: fetch the shards of the next N steps ahead
    cache_budget_bytes: int = 0  # remote data: each dataset's node cache budget (0: no cap)
    # The reference GPT (train/model.py) does not shift: its loss wants next-token labels, so
    # the training config keeps "next" where the library's TokenLoader defaults to "same"
    # (Hugging Face models shift inside). "same" works too: the loop shifts (loop.py).
    labels: Literal["next", "same"] = "next"

    def __post_init__(self) -> None:
        super().__post_init__()
        urls = self.urls
        check(
            bool(urls) and all(isinstance(u, str) and u for u in urls),
            "dataset",
            self.dataset,
            "set the dataset path or URL (or a list of them, blended by weights)",
        )
        if self.weights is not None:
            check(
                len(self.weights) == len(urls),
                "weights",
                self.weights,
                f"give one weight per dataset ({len(urls)})",
            )
        check(self.prefetch_steps >= 0, "prefetch_steps", self.prefetch_steps, "use 0 (off)+")
        check(
            self.cache_budget_bytes >= 0,
            "cache_budget_bytes",
            self.cache_budget_bytes,
            "use 0 (unlimited) or a positive byte count",
        )

    @property
    def urls(self) -> list[str]:
        """The datasets, as a list (one entry unless blending)."""
        return [self.dataset] if isinstance(self.dataset, str) else list(self.dataset)


@dataclasses.dataclass(kw_only=True)
class CheckpointSection(CheckpointerConfig):
    """``[checkpoint]``: the ``Checkpointer``'s own settings plus where and which engine."""

    dir: str = ""  # default RUN_DIR/checkpoints
    # "dcp": the Checkpointer (sharded, async, COMMIT); "torch_save": the classic baseline,
    # one file written synchronously by rank 0 (benchmarks; DDP, steps interval only)
    engine: Literal["dcp", "torch_save"] = "dcp"


@dataclasses.dataclass(kw_only=True)
class MonitorSection(MeterConfig):
    """``[monitor]``: the ``GoodputMeter``'s own settings, with MLflow on by default.

    A training run logs to MLflow unless told not to (``sinks = ["jsonl"]``): by default
    into ``sqlite:///RUN_DIR/mlflow.db``, or to ``tracking_uri`` (a server). The library's
    ``MeterConfig`` stays ledger-only, so ``GoodputMeter`` users opt in and a plain
    ``pip install steadytrain`` needs no MLflow.
    """

    sinks: list[Any] = dataclasses.field(default_factory=lambda: ["jsonl", "mlflow"])

    def without_missing_extras(self, warn: Callable[[str], None] | None) -> MonitorSection:
        """This config, minus the MLflow sink when its packages are not installed: the run
        goes on with the ledger, and ``warn`` (rank 0's) gets one line naming the fix."""
        if "mlflow" not in self.sinks:
            return self
        why = mlflow_missing(self.tracking_uri)
        if why is None:
            return self
        if warn is not None:
            warn(
                f"warning: {why}. This run continues without MLflow; its ledger "
                "(RUN_DIR/ledger.jsonl) records everything. To leave MLflow off without "
                'this warning, set monitor.sinks = ["jsonl"].'
            )
        return dataclasses.replace(self, sinks=[s for s in self.sinks if s != "mlflow"])


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False
    vocab_size: int = 0  # 0: the dataset's vocabulary

    def __post_init__(self) -> None:
        check(self.n_layer >= 1, "n_layer", self.n_layer, "use at least 1")
        check(self.n_head >= 1, "n_head", self.n_head, "use at least 1")
        check(
            self.n_embd >= 1 and self.n_embd % self.n_head == 0,
            "n_embd",
            self.n_embd,
            f"use a positive multiple of n_head ({self.n_head})",
        )
        check(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "use a value in [0, 1)")
        check(self.vocab_size >= 0, "vocab_size", self.vocab_size, "use 0 or more")


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4  # end of the cosine decay
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", self.lr, "use a positive learning rate")
        check(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, "use 0 <= min_lr <= lr")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "use 0 or more")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "use 0 or more")
        for key in ("beta1", "beta2"):
            check(0 <= getattr(self, key) < 1, key, getattr(self, key), "use a value in [0, 1)")
        check(self.grad_clip >= 0, "grad_clip", self.grad_clip, "use 0 (off) or more")


@dataclasses.dataclass(kw_only=True)
class TrainLoopConfig:
    max_steps: int = 100
    log_every: int = 10
    device: Literal["auto", "cpu", "cuda"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    deterministic: bool = True  # torch.use_deterministic_algorithms; needed for exact resume
    threads: int = 0  # torch.set_num_threads; 0 leaves the default
    trace: bool = True  # per-step losses and sample ids in RUN_DIR/trace-rank{R}.jsonl
    # torchrun's --nnodes MIN:MAX, repeated here: torchrun does not tell its workers the
    # range, and the loop checks at start that every world size in it splits the batch.
    elastic_nnodes: str = ""
    # The process group's collective timeout in seconds (0: torch's default, gloo 30 min);
    # keep it above the hang watchdog's deadlines (docs/monitoring.md).
    backend_timeout_s: float = 0.0
    # Every ``eval_every`` steps (0: never) every rank computes the loss of ``eval_batches``
    # fixed micro-batches, under the watchdog's evaluation phase (loop.py, ``evaluate``).
    eval_every: int = 0
    eval_batches: int = 8

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.max_steps >= 1, "max_steps", self.max_steps, "use at least 1")
        check(
            self.backend_timeout_s >= 0,
            "backend_timeout_s",
            self.backend_timeout_s,
            "use 0 (torch's default) or a number of seconds",
        )
        check(self.log_every >= 1, "log_every", self.log_every, "use at least 1")
        check(self.threads >= 0, "threads", self.threads, "use 0 (default) or more")
        check(self.eval_every >= 0, "eval_every", self.eval_every, "use 0 (off) or more steps")
        check(self.eval_batches >= 1, "eval_batches", self.eval_batches, "use at least 1")
        self.nnodes_range  # noqa: B018 - validates the text now, before any work

    @property
    def nnodes_range(self) -> tuple[int, int] | None:
        """``elastic_nnodes`` as (MIN, MAX): ``"3:4"`` -> (3, 4), ``"4"`` -> (4, 4)."""
        text = self.elastic_nnodes.strip()
        if not text:
            return None
        lo, _, hi = text.partition(":")
        try:
            bounds = (int(lo), int(hi or lo))
        except ValueError:
            bounds = (0, 0)
        check(
            0 < bounds[0] <= bounds[1],
            "elastic_nnodes",
            self.elastic_nnodes,
            'use torchrun\'s --nnodes value, "MIN:MAX" (e.g. "3:4") or "N"',
        )
        return bounds


@dataclasses.dataclass(kw_only=True)
class FaultConfig:
    """Fault injection (tests and demos). Also read from env ``STEADYTRAIN_FAULTS``."""

    kill_at_steps: list[int] = dataclasses.field(default_factory=list)  # mid-step SIGKILL
    kill_in_save_at_steps: list[int] = dataclasses.field(default_factory=list)  # save steps
    kill_rank: int = 0  # the rank that dies (-1: every rank)
    mtbf_s: float = 0.0  # random failures, exponential inter-arrival (0: off)
    seed: int = 0  # seeds the random failure times
    slow_read_at_steps: list[int] = dataclasses.field(default_factory=list)
    slow_read_s: float = 0.0  # added to the data read of those steps (a stall if long)
    hang_at_step: int = 0  # block forever in this step, before its collective (0: off)
    hang_rank: int = 0  # the rank that hangs
    hang_mode: Literal["sleep", "sigstop"] = "sleep"  # sleep in Python, or SIGSTOP itself

    def __post_init__(self) -> None:
        for key in ("kill_at_steps", "kill_in_save_at_steps", "slow_read_at_steps"):
            for s in getattr(self, key):
                check(s >= 1, key, s, "steps are counted from 1")
        check(self.kill_rank >= -1, "kill_rank", self.kill_rank, "use -1 or a rank")
        check(self.mtbf_s >= 0, "mtbf_s", self.mtbf_s, "use 0 (off) or more")
        check(self.slow_read_s >= 0, "slow_read_s", self.slow_read_s, "use 0 or more")
        check(self.hang_at_step >= 0, "hang_at_step", self.hang_at_step, "use 0 (off) or a step")
        check(self.hang_rank >= 0, "hang_rank", self.hang_rank, "use a rank (0 or more)")
        check_choices(self)

    @property
    def any(self) -> bool:
        return bool(
            self.kill_at_steps
            or self.kill_in_save_at_steps
            or self.mtbf_s
            or (self.slow_read_at_steps and self.slow_read_s)
            or self.hang_at_step
        )


@dataclasses.dataclass(kw_only=True)
class Config:
    run_dir: str = "runs/steadytrain"
    seed: int = 0  # model init and data order
    data: DataSection
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainLoopConfig = dataclasses.field(default_factory=TrainLoopConfig)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    monitor: MonitorSection = dataclasses.field(default_factory=MonitorSection)
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)
    # [recovery]: in-place recovery of a process fault (steadytrain/run_inplace.py)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        check(bool(self.run_dir), "run_dir", self.run_dir, "set a directory for this run")
        if self.checkpoint.engine == "torch_save":
            check(
                self.train.parallel == "ddp" and self.checkpoint.interval == "steps",
                "checkpoint.engine",
                "torch_save",
                'the torch.save baseline needs train.parallel = "ddp" and '
                'checkpoint.interval = "steps"',
            )

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "data": DataSection,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainLoopConfig,
    "checkpoint": CheckpointSection,
    "monitor": MonitorSection,
    "faults": FaultConfig,
    "recovery": RecoveryConfig,
}
_build_section = from_table  # the name train/faults.py imports

# Keys that moved to the component that owns them, still accepted where they were.
_MOVED = {("train", "expected_tokens_per_s"): ("monitor", "expected_tokens_per_s")}


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a ``Config`` from nested dicts (a parsed TOML file)."""
    raw = copy.deepcopy(raw)
    for (old_sec, old_key), (new_sec, new_key) in _MOVED.items():
        if isinstance(raw.get(old_sec), dict) and old_key in raw[old_sec]:
            value = raw[old_sec].pop(old_key)
            raw.setdefault(new_sec, {}).setdefault(new_key, value)
    top = {k: v for k, v in raw.items() if k not in _SECTIONS}
    unknown = sorted(set(top) - {"run_dir", "seed"})
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r}; top-level keys are run_dir, seed and the sections "
            f"{sorted(_SECTIONS)}"
        )
    if "data" not in raw:
        raise ConfigError("the config has no [data] section: set at least data.dataset")
    kwargs: dict[str, Any] = {}
    if "run_dir" in top:
        kwargs["run_dir"] = coerce(top["run_dir"], str, "run_dir")
    if "seed" in top:
        kwargs["seed"] = coerce(top["seed"], int, "seed")
    for name, cls in _SECTIONS.items():
        if name in raw:
            kwargs[name] = from_table(cls, raw[name], name)
    return Config(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (``monitor.alerts.window=50`` reaches a nested
    table) to a copy of a nested dict; values are coerced when the config is built."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=3e-4")
        *path, field = key.split(".")
        if path and path[0] not in _SECTIONS:
            raise ConfigError(
                f"--set {item!r}: unknown section {path[0]!r}; use {sorted(_SECTIONS)}"
            )
        table = out
        for part in path:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--set {item!r}: {part} is a value, not a table")
        table[field] = Text(value)
    return out


def load_config(path: str | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file or packaged config (``None``: no file), apply ``--set``, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(resolve_config_path(path))
    return config_from_dict(apply_overrides(raw, overrides or []))


def resolve_config_path(name: str) -> str:
    """A file path as given, or a packaged config by name (``demo`` -> configs/demo.toml)."""
    if os.path.exists(name) or os.sep in name or name.endswith(".toml"):
        return name
    from importlib import resources

    packaged = resources.files("steadytrain") / "configs" / f"{name}.toml"
    if packaged.is_file():
        return str(packaged)
    raise ConfigError(f"config {name!r} is neither a file nor a packaged config (demo, small)")
