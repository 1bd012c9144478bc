"""Training config: TOML + --set overrides, type coercion, validation with clear errors;
fault specs from the environment; the LR schedule; deterministic model init."""

from __future__ import annotations

import pytest
import torch

from steadytrain.errors import ConfigError
from steadytrain.train.config import load_config, resolve_config_path
from steadytrain.train.faults import FaultInjector, faults_from_env
from steadytrain.train.loop import lr_factor
from steadytrain.train.model import GPT, GPTConfig


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
        ("data.global_batch=7", "multiple of data.micro_batch"),
        ("checkpoint.async_mode=fast", "choose one of ['sync', 'thread', 'process']"),
        ("checkpoint.keep_last=1", "keep at least 2"),
        ("model.n_embd=65", "multiple of model.n_head"),
        ("optim.nope=1", "unknown key optim.nope"),
        ("bogus.x=1", "unknown section 'bogus'"),
        ("novalue", "expected key=value"),
        ("train.deterministic=maybe", "expected bool"),
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
