"""Training configuration: dataclasses per component, a TOML file, ``--set key=value``.

Each section is a ``kw_only`` dataclass that checks itself in ``__post_init__`` and raises
``ConfigError`` naming the key and the fix, so a bad value stops the job before any process
group, dataset or checkpoint is touched. File and command-line parsing are a thin layer:
``load_config(path, ["optim.lr=3e-4", "train.max_steps=50"])``. Values given with ``--set``
are coerced to the field's type (``int``, ``float``, ``bool``, ``str``, ``list[int]``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]

from steadytrain.errors import ConfigError

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainLoopConfig",
    "CheckpointConfig",
    "FaultConfig",
    "Config",
    "load_config",
    "apply_overrides",
    "coerce",
    "resolve_config_path",
]


def _check(cond: bool, key: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: {fix}")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    dataset: str = ""  # local path or URL (s3://bucket/prefix)
    cache_dir: str = ""  # node-local cache; required when the dataset is remote
    seq_len: int = 64
    global_batch: int = 8  # samples per optimizer step, over all ranks
    micro_batch: int = 2  # samples per forward/backward on one rank
    shuffle: Literal["global", "block", "sequential"] = "global"  # data.modes
    num_workers: int = 0
    preflight: bool = True  # check every shard is reachable before the first step
    prefetch_steps: int = 64  # remote data: fetch the shards of the next N steps ahead
    cache_budget_bytes: int = 0  # remote data: node cache byte budget (0: unlimited)

    def __post_init__(self) -> None:
        _check(bool(self.dataset), "data.dataset", self.dataset, "set the dataset path or URL")
        _check(self.seq_len >= 2, "data.seq_len", self.seq_len, "use at least 2")
        _check(self.micro_batch >= 1, "data.micro_batch", self.micro_batch, "use at least 1")
        _check(
            self.global_batch >= self.micro_batch and self.global_batch % self.micro_batch == 0,
            "data.global_batch",
            self.global_batch,
            f"use a positive multiple of data.micro_batch ({self.micro_batch})",
        )
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "use 0 or more")
        _check(self.prefetch_steps >= 0, "data.prefetch_steps", self.prefetch_steps, "use 0+")
        _check(
            self.cache_budget_bytes >= 0,
            "data.cache_budget_bytes",
            self.cache_budget_bytes,
            "use 0 (unlimited) or a positive byte count",
        )


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False
    vocab_size: int = 0  # 0: the dataset's vocabulary

    def __post_init__(self) -> None:
        _check(self.n_layer >= 1, "model.n_layer", self.n_layer, "use at least 1")
        _check(self.n_head >= 1, "model.n_head", self.n_head, "use at least 1")
        _check(
            self.n_embd >= 1 and self.n_embd % self.n_head == 0,
            "model.n_embd",
            self.n_embd,
            f"use a positive multiple of model.n_head ({self.n_head})",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "use a value in [0, 1)")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "use 0 or more")


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
        _check(self.lr > 0, "optim.lr", self.lr, "use a positive learning rate")
        _check(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "use 0 <= min_lr <= lr")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "use 0 or more")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "use 0 or more")
        for key, beta in (("optim.beta1", self.beta1), ("optim.beta2", self.beta2)):
            _check(0 <= beta < 1, key, beta, "use a value in [0, 1)")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "use 0 (off) or more")


@dataclasses.dataclass(kw_only=True)
class TrainLoopConfig:
    max_steps: int = 100
    log_every: int = 10
    device: Literal["auto", "cpu", "cuda"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    deterministic: bool = True  # torch.use_deterministic_algorithms; needed for exact resume
    threads: int = 0  # torch.set_num_threads; 0 leaves the default
    expected_tokens_per_s: float = 0.0  # throughput band for the ledger's alerts; 0: learn it
    trace: bool = True  # per-step losses and sample ids in RUN_DIR/trace-rank{R}.jsonl

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, "train.max_steps", self.max_steps, "use at least 1")
        _check(self.log_every >= 1, "train.log_every", self.log_every, "use at least 1")
        _check(self.threads >= 0, "train.threads", self.threads, "use 0 (default) or more")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""  # default RUN_DIR/checkpoints
    every_steps: int = 0  # 0: not by steps
    every_seconds: float = 0.0  # 0: not by time
    interval: Literal["steps", "seconds", "auto"] = "steps"
    keep_last: int = 3
    async_mode: Literal["sync", "thread", "process"] = "thread"
    remote: str = ""  # optional s3://… copy of every committed checkpoint
    # "dcp": the Checkpointer (sharded, async, COMMIT); "torch_save": the classic baseline,
    # one file written synchronously by rank 0 (benchmarks; DDP, steps interval only)
    engine: Literal["dcp", "torch_save"] = "dcp"
    mtbf_s: float = 0.0  # the job's mean time between failures, for interval = "auto"
    # How a restore checks checksums. "overlap": hashed while the bytes stream into the
    # fresh model (one read; a damaged shard falls back to the next older checkpoint);
    # "full": everything verified before any tensor is written (one extra memory copy).
    verify: Literal["full", "overlap"] = "overlap"

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps, "use 0 or more")
        _check(self.every_seconds >= 0, "checkpoint.every_seconds", self.every_seconds, "use >= 0")
        if self.interval == "steps":
            _check(
                self.every_steps >= 1,
                "checkpoint.every_steps",
                self.every_steps,
                'set it (>= 1) with checkpoint.interval = "steps"',
            )
        if self.interval == "seconds":
            _check(
                self.every_seconds > 0,
                "checkpoint.every_seconds",
                self.every_seconds,
                'set it (> 0) with checkpoint.interval = "seconds"',
            )
        if self.interval == "auto":
            _check(
                self.mtbf_s > 0,
                "checkpoint.mtbf_s",
                self.mtbf_s,
                'set the job\'s mean time between failures (seconds) with interval = "auto"',
            )
        _check(
            self.keep_last >= 2,
            "checkpoint.keep_last",
            self.keep_last,
            "keep at least 2: a crash during a save must leave the previous one",
        )


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

    def __post_init__(self) -> None:
        for key in ("kill_at_steps", "kill_in_save_at_steps", "slow_read_at_steps"):
            for s in getattr(self, key):
                _check(s >= 1, f"faults.{key}", s, "steps are counted from 1")
        _check(self.kill_rank >= -1, "faults.kill_rank", self.kill_rank, "use -1 or a rank")
        _check(self.mtbf_s >= 0, "faults.mtbf_s", self.mtbf_s, "use 0 (off) or more")
        _check(self.slow_read_s >= 0, "faults.slow_read_s", self.slow_read_s, "use 0 or more")

    @property
    def any(self) -> bool:
        return bool(
            self.kill_at_steps
            or self.kill_in_save_at_steps
            or self.mtbf_s
            or (self.slow_read_at_steps and self.slow_read_s)
        )


@dataclasses.dataclass(kw_only=True)
class Config:
    run_dir: str = "runs/steadytrain"
    seed: int = 0  # model init and data order
    data: DataConfig
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainLoopConfig = dataclasses.field(default_factory=TrainLoopConfig)
    checkpoint: CheckpointConfig = dataclasses.field(
        default_factory=lambda: CheckpointConfig(every_steps=50)
    )
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        _check(bool(self.run_dir), "run_dir", self.run_dir, "set a directory for this run")
        if self.checkpoint.engine == "torch_save":
            _check(
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


_SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainLoopConfig,
    "checkpoint": CheckpointConfig,
    "faults": FaultConfig,
}


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML value or a ``--set`` string to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is invalid: choose one of {list(choices)}")
        return value
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").strip("[]").split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} is invalid: give a list, e.g. [5, 12]")
        return [coerce(v, item, key) for v in value]
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is str:
            return str(value)
    except (TypeError, ValueError):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{key} = {value!r} is invalid: expected {name}") from None
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def _build_section(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{prefix}] must be a table, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}.{unknown[0]}; known keys of [{prefix}]: {sorted(fields)}"
        )
    kwargs = {k: coerce(v, hints[k], f"{prefix}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a ``Config`` from nested dicts (a parsed TOML file)."""
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
            kwargs[name] = _build_section(cls, raw[name], name)
    return Config(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a nested dict (values coerced at build time)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=3e-4")
        section, dot, field = key.partition(".")
        if not dot:
            out[key] = value
            continue
        if section not in _SECTIONS:
            raise ConfigError(
                f"--set {item!r}: unknown section {section!r}; use {sorted(_SECTIONS)}"
            )
        out.setdefault(section, {})[field] = value
    return out


def load_config(path: str | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file or packaged config (``None``: no file), apply ``--set``, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
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
