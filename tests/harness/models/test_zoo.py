"""The tiny model zoo: every hybrid mlx-lm type loads through the real ``mlx_lm.load`` and runs.

Each model is written once (``write_tiny``), loaded with ``mlx_lm.load`` and probed with a
20-token prompt and 3 decode steps on ``make_prompt_cache``; the probes are shared per module.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from harness.models import zoo

HYBRIDS = [t for t in zoo.HYBRIDS if t in zoo.CONFIGS]
RECURRENT_ONLY = {"mamba", "mamba2", "rwkv7"}
EVERY_LAYER_BOTH = {"falcon_h1", "baichuan_m1"}  # each layer: a recurrent state and attention, in a CacheList


@pytest.fixture(scope="module")
def probes():
    cache: dict[str, dict] = {}

    def get(model_type: str) -> dict:
        if model_type not in cache:
            cache[model_type] = zoo.probe(model_type)
        return cache[model_type]

    return get


def _kinds(c: dict) -> list[str]:
    return [c["kind"]] + [k for child in c.get("children", []) for k in _kinds(child)]


def test_the_zoo_covers_every_named_hybrid_type_this_mlx_lm_ships():
    shipped = set(zoo.model_types())
    assert [t for t in zoo.HYBRIDS if t in shipped and t not in zoo.CONFIGS] == []
    assert {"qwen3_next", "qwen3_5", "lfm2", "nemotron_h", "falcon_h1", "jamba", "mamba", "rwkv7"} <= set(HYBRIDS)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_loads_through_mlx_lm_load_and_gives_finite_logits(probes, model_type):
    p = probes(model_type)
    assert p["ok"], p.get("err")
    assert p["loads"] and p["finite"]
    assert p["weights_roundtrip"], "mlx_lm.load changed the weights write_tiny saved"
    assert p["generate"].startswith("ok"), p["generate"]
    assert p["persist"] == "ok", p["persist"]  # save_prompt_cache + load_prompt_cache give the same next logits
    kinds = [k for c in p["caches"] for k in _kinds(c)]
    assert kinds.count("ArraysCache") >= 2, kinds
    if model_type not in RECURRENT_ONLY:
        assert any(k in ("KVCache", "RotatingKVCache", "ChunkedKVCache") for k in kinds), kinds
    if model_type not in EVERY_LAYER_BOTH | RECURRENT_ONLY:
        # a layer either recurs or attends: recurrent layers own an ArraysCache, attention layers a KV cache
        assert sum(c["kind"] == "ArraysCache" for c in p["caches"]) >= 2
        assert any(c["kind"] != "ArraysCache" for c in p["caches"])


def test_hybrid_recurrent_state_is_written_by_the_prompt(probes):
    for model_type in ("qwen3_next", "lfm2", "mamba", "rwkv7"):
        arrays = [a for c in probes(model_type)["caches"] if c["kind"] == "ArraysCache" for a in c["arrays"]]
        assert arrays and None not in arrays, (model_type, arrays)


def test_gpt_oss_alternates_a_128_token_rotating_cache_with_full_ones(probes):
    p = probes("gpt_oss")
    assert p["ok"], p.get("err")
    assert [c["kind"] for c in p["caches"]] == ["RotatingKVCache", "KVCache"] * 2
    assert [c.get("max_size") for c in p["caches"] if c["kind"] == "RotatingKVCache"] == [128, 128]


def test_gemma4_text_shares_kv_so_it_has_fewer_caches_than_layers(probes):
    p = probes("gemma4_text")
    assert p["ok"], p.get("err")
    assert p["n_caches"] < p["n_layers"]
    assert p["n_layers"] - p["n_caches"] == zoo.CONFIGS["gemma4_text"]["num_kv_shared_layers"]
    assert zoo.CONFIGS["gemma4_text"]["global_head_dim"] != zoo.CONFIGS["gemma4_text"]["head_dim"]


def test_write_tiny_writes_a_directory_with_config_weights_and_chat_template(tmp_path):
    path = zoo.write_tiny("qwen3_next", tmp_path / "m", seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["full_attention_interval"] == 2
    assert (path / "model.safetensors").exists()
    assert "chat_template" in (path / "tokenizer_config.json").read_text() or (path / "chat_template.jinja").exists()
    weights = mx.load(str(path / "model.safetensors"))
    again = mx.load(str(zoo.write_tiny("qwen3_next", tmp_path / "n", seed=3) / "model.safetensors"))
    assert all(mx.array_equal(weights[k], again[k]) for k in weights)  # seeded: the same weights again


@pytest.mark.slow
def test_every_zoo_type_loads_and_runs_or_needs_a_metal_kernel(probes):
    failed = {t: p.get("err") for t in zoo.CONFIGS if not (p := probes(t))["ok"]}
    assert {t: e for t, e in failed.items() if "Metal" not in (e or "")} == {}
