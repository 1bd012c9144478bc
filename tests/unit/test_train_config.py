"""Training config: TOML + --set overrides, type coercion, validation with clear errors;
the [data], [checkpoint] and [monitor] tables are the components' own configs (one default,
one check, every key reaching the component); fault specs from the environment; the LR
schedule; deterministic model init."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import steadytrain
from steadytrain.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import LoaderConfig, TokenLoader
from steadytrain.errors import ConfigError
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.settings import InvalidSetting
from steadytrain.storage.retry import ENV_VARS, RetryPolicy
from steadytrain.testing import forkserver
from steadytrain.train.config import (
    config_from_dict,
    load_config,
    resolve_config_path,
)
from steadytrain.train.faults import FaultInjector, faults_from_env
from steadytrain.train.loop import lr_factor
from steadytrain.train.model import GPT, GPTConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))

from harness import BASE_SETTINGS, make_dataset, read_trace  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"data": {"dataset": "/d", "seq_len": 16, "global_batch": 4, "micro_batch": 2}}


def test_packaged_configs_load_with_overrides() -> None:
    for name in ("demo", "small"):
        cfg = load_config(resolve_config_path(name), ["data.dataset=/tmp/ds"])
        assert cfg.data.dataset == "/tmp/ds"
    cfg = load_config(
        resolve_config_path("demo"),
        [
            "data.dataset=/d",
            "optim.lr=3e-4",
            "train.max_steps=7",
            "train.deterministic=false",
            "faults.kill_at_steps=3,5",
            "checkpoint.async_mode=sync",
            "seed=11",
        ],
    )
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 7 and cfg.train.deterministic is False
    assert cfg.faults.kill_at_steps == [3, 5]
    assert cfg.checkpoint.async_mode == "sync" and cfg.seed == 11


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.max_steps=abc", "train.max_steps = 'abc' is invalid: expected int"),
        ("train.max_steps=0", "train.max_steps = 0 is invalid"),
        (
            "data.global_batch=7",
            "data.global_batch = 7 is invalid: use a positive multiple of micro_batch",
        ),
        ("checkpoint.async_mode=fast", "choose one of ['sync', 'thread', 'process']"),
        ("checkpoint.keep_last=1", "keep at least 2"),
        ("model.n_embd=65", "model.n_embd = 65 is invalid: use a positive multiple of n_head"),
        ("optim.nope=1", "unknown key optim.nope"),
        ("bogus.x=1", "unknown section 'bogus'"),
        ("novalue", "expected key=value"),
        ("train.deterministic=maybe", "expected bool"),
        ("train.eval_every=-1", "train.eval_every = -1 is invalid: use 0 (off) or more steps"),
        ("train.eval_batches=0", "train.eval_batches = 0 is invalid: use at least 1"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(resolve_config_path("demo"), ["data.dataset=/d", override])
    assert needle in str(info.value)


def test_missing_dataset_and_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.dataset"):
        load_config(resolve_config_path("demo"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[data\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_faults_from_env_override_the_file(tmp_path) -> None:
    cfg = load_config(resolve_config_path("demo"), ["data.dataset=/d", "faults.mtbf_s=5"])
    env = {"STEADYTRAIN_FAULTS": "kill_at_steps=4,9; kill_rank=1;slow_read_s=0.5"}
    f = faults_from_env(cfg.faults, env)
    assert f.kill_at_steps == [4, 9] and f.kill_rank == 1 and f.mtbf_s == 5.0
    with pytest.raises(ConfigError, match="not key=value"):
        faults_from_env(cfg.faults, {"STEADYTRAIN_FAULTS": "kill"})
    # A stall fires once per run (the marker survives the restart), and only at its step.
    f = faults_from_env(cfg.faults, {"STEADYTRAIN_FAULTS": "slow_read_at_steps=2;slow_read_s=0.01"})
    inj = FaultInjector(f, str(tmp_path), rank=0)
    assert inj.before_data(1) == 0.0
    assert inj.before_data(2) == pytest.approx(0.01)
    assert FaultInjector(f, str(tmp_path), rank=0).before_data(2) == 0.0


def test_lr_schedule_warms_up_then_decays() -> None:
    f = [lr_factor(s, warmup=4, total=20, min_ratio=0.1) for s in range(25)]
    assert f[0] < f[1] < f[3] < f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:20], f[5:21], strict=True))
    assert f[20] == f[24] == pytest.approx(0.1)


def test_model_init_is_a_function_of_the_seed() -> None:
    cfg = GPTConfig(vocab_size=257, seq_len=16)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = GPT(cfg, seed=1), GPT(cfg, seed=1), GPT(cfg, seed=2)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left alone
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])
    x = torch.randint(0, 257, (2, 16))
    _, loss = a(x, torch.randint(0, 257, (2, 16)))
    assert loss is not None and 5.0 < float(loss) < 6.0  # ~ln(257) at init


# -- one config per component -----------------------------------------------------------


def _values(obj: Any, cls: type) -> dict[str, Any]:
    """The fields ``cls`` declares, read from ``obj`` (which may be a subclass)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}


def test_toml_tables_are_the_components_configs_with_their_defaults(tmp_path) -> None:
    cfg = config_from_dict(MINIMAL)
    # The tables are the component configs (subclasses add where/which), not copies.
    assert isinstance(cfg.checkpoint, CheckpointerConfig) and isinstance(cfg.data, LoaderConfig)
    assert isinstance(cfg.monitor, MeterConfig) and type(cfg.monitor.alerts) is AlertConfig
    assert _values(cfg.checkpoint, CheckpointerConfig) == _values(
        CheckpointerConfig(), CheckpointerConfig
    )
    # One deliberate difference: training logs to MLflow by default, the library opts in.
    assert (cfg.monitor.sinks, MeterConfig().sinks) == (["jsonl", "mlflow"], ["jsonl"])
    monitor_values = {**_values(cfg.monitor, MeterConfig), "sinks": ["jsonl"]}
    assert monitor_values == _values(MeterConfig(), MeterConfig)
    loader_defaults = LoaderConfig(seq_len=16, global_batch=4, micro_batch=2)
    # One deliberate difference: the reference GPT does not shift, so [data] keeps "next"
    # labels where the library defaults to "same" (Hugging Face models shift inside).
    assert (cfg.data.labels, loader_defaults.labels) == ("next", "same")
    data_values = {**_values(cfg.data, LoaderConfig), "labels": loader_defaults.labels}
    assert data_values == _values(loader_defaults, LoaderConfig)
    # The two defaults that had drifted apart: one value now, the safe one.
    assert (cfg.checkpoint.verify, cfg.checkpoint.keep_last) == ("full", 3)
    # A component built from keywords alone runs with exactly those values.
    ckpt = Checkpointer(str(tmp_path / "ck"))
    assert ckpt.config == CheckpointerConfig()
    assert (ckpt.verify, ckpt.keep_last) == (cfg.checkpoint.verify, cfg.checkpoint.keep_last)
    meter = GoodputMeter(tmp_path / "run")
    assert meter.config == MeterConfig() and meter.snapshot_every == cfg.monitor.snapshot_every
    meter.close()
    ds = TokenDataset.open(make_dataset(str(tmp_path / "ds"), max_bytes=20_000))
    with TokenLoader(ds, seq_len=16, global_batch=4, micro_batch=2) as loader:
        assert loader.config == loader_defaults
        assert loader.prefetch == cfg.data.prefetch and loader.read_timeout_s is None


@pytest.mark.parametrize(
    ("component", "config_cls"),
    [(Checkpointer, CheckpointerConfig), (TokenLoader, LoaderConfig), (GoodputMeter, MeterConfig)],
)
def test_keyword_constructors_hold_no_default_of_their_own(component, config_cls) -> None:
    """Every setting keyword defaults to None ("not given"): the value comes from the
    config class, so a default cannot drift between the two again."""
    fields = {f.name for f in dataclasses.fields(config_cls)} | {"alert_config"}
    params = inspect.signature(component.__init__).parameters
    own = {n: p.default for n, p in params.items() if n in fields and p.default is not None}
    assert own == {}
    assert "config" in params


def test_keywords_and_config_build_the_same_component(tmp_path) -> None:
    by_keywords = Checkpointer(str(tmp_path / "a"), every_steps=5, keep_last=4, verify="overlap")
    config = CheckpointerConfig(every_steps=5, keep_last=4, verify="overlap")
    by_config = Checkpointer(str(tmp_path / "b"), config=config)
    assert by_keywords.config == by_config.config == config
    # A keyword given with config= wins, and the result is checked again.
    assert Checkpointer(str(tmp_path / "c"), keep_last=7, config=config).keep_last == 7
    with pytest.raises(InvalidSetting, match="keep_last = 1"):
        Checkpointer(str(tmp_path / "d"), keep_last=1, config=config)


def _origin(exc: BaseException) -> tuple[str, int]:
    """The file and line of the check that raised ``exc`` (the caller of ``check``)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    frames = [f for f in frames if f.tb_frame.f_code.co_name != "check"]
    return frames[-1].tb_frame.f_code.co_filename, frames[-1].tb_lineno


@pytest.mark.parametrize(
    ("override", "toml_key", "build"),
    [
        ("checkpoint.keep_last=1", "checkpoint.keep_last", lambda d: Checkpointer(d, keep_last=1)),
        ("checkpoint.verify=fast", "checkpoint.verify", lambda d: Checkpointer(d, verify="fast")),
        (
            "checkpoint.keep_every=-1",
            "checkpoint.keep_every",
            lambda d: Checkpointer(d, keep_every=-1),
        ),
        (
            "data.read_timeout_s=0",
            "data.read_timeout_s",
            lambda d: LoaderConfig(seq_len=8, global_batch=4, micro_batch=2, read_timeout_s=0),
        ),
        (
            "monitor.snapshot_every=0",
            "monitor.snapshot_every",
            lambda d: MeterConfig(snapshot_every=0),
        ),
        ("monitor.alerts.window=1", "monitor.alerts.window", lambda d: AlertConfig(window=1)),
    ],
)
def test_a_bad_value_is_refused_by_the_one_check_naming_the_key(
    tmp_path, override: str, toml_key: str, build: Any
) -> None:
    with pytest.raises(InvalidSetting) as from_toml:
        load_config(resolve_config_path("demo"), ["data.dataset=/d", override])
    with pytest.raises(InvalidSetting) as from_python:
        build(str(tmp_path))
    assert from_toml.value.key == toml_key and toml_key.endswith("." + from_python.value.key)
    assert str(from_toml.value).startswith(f"{toml_key} = ")
    assert from_toml.value.fix == from_python.value.fix
    # One check: the TOML error is the component's own, raised by the same line of code.
    assert _origin(from_toml.value.__context__) == _origin(from_python.value)


def test_nested_tables_lists_and_tables_from_set() -> None:
    cfg = load_config(
        resolve_config_path("demo"),
        [
            "data.dataset=[/a, /b]",
            "data.weights=3,1",
            "data.shuffle_settings.block_size=4096",
            "checkpoint.storage_options={endpoint_url = 'http://s3:8333', key = 'k'}",
            "monitor.expected_tokens_per_s=[100, 200]",
            "monitor.alerts.window=9",
            "train.expected_tokens_per_s=50",  # the old place: moved to [monitor]
        ],
    )
    assert cfg.data.urls == ["/a", "/b"] and cfg.data.weights == [3.0, 1.0]
    assert cfg.data.shuffle_settings == {"block_size": 4096}
    assert cfg.checkpoint.storage_options == {"endpoint_url": "http://s3:8333", "key": "k"}
    assert cfg.monitor.expected_tokens_per_s == (100.0, 200.0)
    assert cfg.monitor.alerts.window == 9 and cfg.monitor.alerts.sustain == 10
    moved = load_config(
        resolve_config_path("demo"), ["data.dataset=/d", "train.expected_tokens_per_s=50"]
    )
    assert moved.monitor.expected_tokens_per_s == 50.0
    with pytest.raises(
        ConfigError, match="data.weights = \\[1.0\\] is invalid: give one weight per"
    ):
        load_config(resolve_config_path("demo"), ["data.dataset=[/a, /b]", "data.weights=[1]"])
    with pytest.raises(ConfigError, match="data.seq_len is required"):
        config_from_dict({"data": {"dataset": "/d", "global_batch": 4, "micro_batch": 2}})


def test_every_toml_key_reaches_its_component(tmp_path) -> None:
    a = make_dataset(str(tmp_path / "a"), max_bytes=20_000)
    b = make_dataset(str(tmp_path / "b"), max_bytes=40_000)
    toml = tmp_path / "run.toml"
    toml.write_text(
        f"""
        run_dir = "{tmp_path / "run"}"
        [data]
        dataset = ["{a}", "{b}"]
        weights = [3, 1]
        seq_len = 32
        global_batch = 8
        micro_batch = 2
        shuffle = "block"
        shuffle_settings = {{block_size = 16}}
        read_timeout_s = 5.0
        startup_timeout_s = 30.0
        prefetch = 2
        [checkpoint]
        every_steps = 2
        keep_last = 2
        keep_every = 4
        async_mode = "sync"
        verify = "overlap"
        [monitor]
        expected_tokens_per_s = [1000, 2000]
        snapshot_every = 7
        memory_every = 3
        flush_interval_s = 0.5
        [monitor.alerts]
        window = 9
        data_wait_share = 0.5
        """
    )
    cfg = load_config(str(toml))
    # Built as loop.py builds them: each component gets its table as it is.
    datasets = [TokenDataset.open(url) for url in cfg.data.urls]
    with TokenLoader(datasets, rank=0, world_size=1, seed=cfg.seed, config=cfg.data) as loader:
        assert (loader.read_timeout_s, loader.startup_timeout_s, loader.prefetch) == (5.0, 30.0, 2)
        assert loader.sampler.blend.counts == [3, 1] and loader.sampler.mode == "block"
        assert loader.state_dict()["mode_settings"]["block_size"] == 16
    ckpt = Checkpointer(cfg.checkpoint_dir, config=cfg.checkpoint)
    assert (ckpt.every_steps, ckpt.keep_last, ckpt.keep_every) == (2, 2, 4)
    assert (ckpt.async_mode, ckpt.verify) == ("sync", "overlap")
    meter = GoodputMeter(cfg.run_dir, config=cfg.monitor)
    assert (meter.snapshot_every, meter.memory_every) == (7, 3)
    assert meter._band == (1000.0, 2000.0) and meter._writer._interval == 0.5
    assert meter._engine.cfg.window == 9 and meter._engine.cfg.data_wait_share == 0.5
    meter.close()


@pytest.mark.timeout(120)
def test_the_loop_hands_each_table_to_its_component(tmp_path) -> None:
    """`steadytrain train` with a blend and milestones: the weights reach the loader (3 of
    every 4 samples from the first dataset) and keep_every the checkpointer's retention."""
    a = make_dataset(str(tmp_path / "a"), max_bytes=20_000)
    b = make_dataset(str(tmp_path / "b"), max_bytes=40_000)
    run = tmp_path / "run"
    settings = [
        *BASE_SETTINGS,
        f"run_dir={run}",
        f"data.dataset=[{a}, {b}]",
        "data.weights=3,1",
        "train.max_steps=10",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
        "checkpoint.keep_every=4",
        "monitor.snapshot_every=5",
    ]
    cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
    for s in settings:
        cmd += ["--set", s]
    env = dict(os.environ, STEADYTRAIN_FAULTS="", OMP_NUM_THREADS="1")
    done = forkserver.run(cmd, env=env, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = sorted(i.step for i in discover(Root(str(run / "checkpoints"))) if i.committed)
    assert kept == [4, 8, 10]  # the newest 2 (8, 10) and the milestones (4, 8)
    first = TokenLoader(TokenDataset.open(a), seq_len=64, global_batch=8, micro_batch=2)
    n_first = first.sampler.num_samples[0]  # ids below this are the first dataset's
    first.close()
    ids = [i for rec in read_trace(str(run)) for i in rec["sample_ids"]]
    assert len(ids) == 80
    assert sum(i < n_first for i in ids) == 60  # exactly 3:1, period 4
    with open(run / "ledger.jsonl") as f:
        start = next(json.loads(line) for line in f if '"job_start"' in line)
    assert start["config"]["monitor"]["snapshot_every"] == 5


def test_storage_environment_is_read_in_one_documented_place(monkeypatch) -> None:
    src = Path(steadytrain.__file__).parent
    named = set()
    for path in src.rglob("*.py"):
        named |= set(re.findall(r"STEADYTRAIN_STORAGE_[A-Z_]+", path.read_text()))
    assert named == set(ENV_VARS)  # no variable of that family outside RetryPolicy's table
    docs = (REPO / "docs" / "storage.md").read_text()
    assert all(var in docs for var in ENV_VARS)
    monkeypatch.setenv("STEADYTRAIN_STORAGE_TIMEOUT_S", "7")
    monkeypatch.setenv("STEADYTRAIN_STORAGE_RETRY_S", "70")
    policy = RetryPolicy.from_env()
    assert (policy.request_timeout_s, policy.total_s) == (7.0, 70.0)
    monkeypatch.setenv("STEADYTRAIN_STORAGE_TIMEOUT_S", "0")
    with pytest.raises(ConfigError, match="STEADYTRAIN_STORAGE_TIMEOUT_S='0' is invalid"):
        RetryPolicy.from_env()


def _toml_keys(obj: Any, prefix: str = "") -> set[str]:
    """Every key of a config's tables, nested tables (dataclass values) expanded."""
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= _toml_keys(value, f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def test_every_toml_key_is_documented() -> None:
    doc = (REPO / "docs" / "training.md").read_text()
    keys = _toml_keys(config_from_dict(MINIMAL))
    assert "monitor.alerts.window" in keys and "checkpoint.storage_options" in keys
    assert sorted(k for k in keys if f"`{k}`" not in doc) == []
