"""Experiment configs: validation names the file, the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import config

ROOT = Path(__file__).parents[2]
GOOD = """
name = "t"
kind = "cache_injection"
models = ["smollm2-135m"]
[params]
history_tokens = 32
[protocol]
warmup = 0
trials = 3
[quick]
"params.history_tokens" = 8
"protocol.trials" = 2
[[criteria]]
name = "match"
value = "checks.outputs_match"
op = "=="
threshold = true
[outputs]
plots = ["cdf"]
"""


def _write(tmp_path, text, name="x.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_committed_experiment_config_is_valid():
    paths = sorted((ROOT / "experiments").glob("*.toml"))
    assert len(paths) >= 2
    for path in paths:
        cfg = config.load(path)
        assert cfg.name == path.stem
        config.load(path, quick=True)


def test_defaults_are_filled_in_and_quick_and_set_override_in_order(tmp_path):
    path = _write(tmp_path, GOOD)
    cfg = config.load(path)
    assert cfg.params["history_tokens"] == 32 and cfg.params["max_tokens"] == 10  # default
    assert (cfg.protocol.warmup, cfg.protocol.trials) == (0, 3)
    quick = config.load(path, quick=True, overrides=["protocol.trials=4", 'params.followup=" And"'])
    assert quick.params["history_tokens"] == 8 and quick.protocol.trials == 4
    assert quick.params["followup"] == " And"
    assert quick.sha256() != cfg.sha256()
    assert config.load(path).sha256() == cfg.sha256()


@pytest.mark.parametrize(
    "edit,key,allowed",
    [
        (lambda t: 'colour = "red"\n' + t, "colour", "allowed"),
        (lambda t: t + 'colour = "red"\n', "outputs.colour", "allowed"),
        (lambda t: t.replace("trials = 3", "trials = 3\nrounds = 2"), "protocol.rounds", "allowed"),
        (lambda t: t.replace("history_tokens = 32", "history_tokenz = 32"), "params.history_tokenz", "history_tokens"),
        (lambda t: t.replace("history_tokens = 32", 'history_tokens = "many"'), "params.history_tokens", "must be int"),
        (lambda t: t.replace("history_tokens = 32", "history_tokens = -1"), "params.history_tokens", "must be >= 0"),
        (lambda t: t.replace('kind = "cache_injection"', 'kind = "nope"'), "kind", "allowed"),
        (lambda t: t.replace('["smollm2-135m"]', '["gpt-9"]'), "models", "allowed"),
        (lambda t: t.replace("trials = 3", "trials = 0"), "protocol", "trials must be"),
        (lambda t: t.replace('op = "=="', 'op = "~"'), "criteria[0]", "op must be"),
        (lambda t: t.replace('plots = ["cdf"]', 'plots = ["pie"]'), "outputs.plots", "draws"),
    ],
)
def test_a_bad_config_names_the_file_the_key_and_what_is_allowed(tmp_path, edit, key, allowed):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(config.ConfigError) as err:
        config.load(path)
    message = str(err.value)
    assert str(path) in message and key in message and allowed in message


@pytest.mark.parametrize(
    "config_name,override,message",
    [
        ("exp_003_cache_injection", "params.max_tokens=0", "params.max_tokens: must be >= 1, got 0"),
        ("exp_008_stress", "params.agents=1", "params.agents: must be >= 2, got 1"),
        ("exp_008_stress", "params.edit_prob=1.5", "params.edit_prob: must be >= 0 and <= 1, got 1.5"),
        ("exp_008_stress", "params.ram_budget=-0.1", "params.ram_budget: must be >= 0 and <= 1"),
        ("exp_013_responses", "params.turns=99", "params.turns: must be >= 2 and <= "),
        ("exp_015_chaos", "params.chaos_s=0", "params.chaos_s: must be > 0, got 0.0"),
        ("exp_019_models", "params.switch_fit=1", "params.switch_fit: must be > 0 and < 1, got 1.0"),
        ("exp_008_stress", "params.question_tokens=[8, 4]",
         "params.question_tokens: must be [low, high], integers >= 1 with low <= high, got [8, 4]"),
        ("exp_008_stress", "params.question_tokens=[0, 4]", "params.question_tokens: must be [low, high]"),
        ("exp_008_stress", "params.answer_tokens=[4]", "params.answer_tokens: must be [low, high]"),
        ("exp_015_chaos", "params.turns_per_session=[3, 5, 7]", "params.turns_per_session: must be [low, high]"),
        ("exp_006_reconstruction", "params.blocks=[1, 0]", "params.blocks: must be a non-empty list of integers >= 1"),
        ("exp_006_reconstruction", "params.layers=[]", "params.layers: must be a non-empty list of integers >= 1"),
        ("exp_011_agents_act", "params.decode_batches=[2.5]", "params.decode_batches: must be a list of integers >= 1"),
        ("exp_019_models", 'params.peers=["vllm-mlx"]',
         "params.peers: must be a list of items among ['mlx_lm.server'], got ['vllm-mlx']"),
        ("exp_015_chaos", 'params.cache_layout="flat"', "params.cache_layout: must be one of ['blocks', 'file']"),
    ],
)
def test_a_value_out_of_its_declared_bounds_is_refused_naming_the_param_and_the_bound(config_name, override, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(config_name, overrides=[override])
    assert message in str(err.value)


def test_values_on_their_declared_bounds_are_accepted():
    cfg = config.load("exp_008_stress", overrides=["params.question_tokens=[1, 1]", "params.edit_prob=1",
                                                   "params.ram_budget=0", "params.agents=2"])
    assert cfg.params["question_tokens"] == [1, 1] and cfg.params["edit_prob"] == 1.0
    assert config.load("exp_011_agents_act", overrides=["params.decode_batches=[]"]).params["decode_batches"] == []


def test_set_needs_key_equals_value_and_toml_errors_name_the_file(tmp_path):
    path = _write(tmp_path, GOOD)
    with pytest.raises(config.ConfigError, match="expected key=value"):
        config.load(path, overrides=["protocol.trials"])
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.load(path, overrides=["bogus=1"])
    broken = _write(tmp_path, "name = ", "broken.toml")
    with pytest.raises(config.ConfigError, match="broken.toml: not valid TOML"):
        config.load(broken)
    with pytest.raises(config.ConfigError, match="no such config file"):
        config.load(tmp_path / "missing.toml")
