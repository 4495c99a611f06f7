"""ModelCacheSpec from live models and from configs alone."""

from __future__ import annotations

import pytest

from semantic import CacheMismatchError, LayerSpec, ModelCacheSpec, UnsupportedCacheError
from semantic.cache.spec import GLOBAL, SLIDING

pytestmark = pytest.mark.compat

GEMMA3_12B = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_size": 3840,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "torch_dtype": "bfloat16",
}


def test_spec_from_a_llama_model_is_all_global(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    assert spec.n_layers == 3 and spec.n_kv_heads == 2 and spec.head_dim == 32 and spec.dtype == "float32"
    assert {l.kind for l in spec.layers} == {GLOBAL} and not spec.quantized
    assert spec.groups() == {"global": (0, 1, 2)}


def test_spec_from_a_gemma_model_mixes_sliding_and_global_layers(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    assert [l.kind for l in spec.layers] == [SLIDING, GLOBAL, SLIDING, GLOBAL]
    assert spec.layers[0].window == 8 and spec.layers[0].keep == 0
    assert spec.groups() == {"sliding-w8-k0": (0, 2), "global": (1, 3)}
    assert [type(c).__name__ for c in spec.make_cache()] == ["RotatingKVCache", "KVCache"] * 2


def test_kv_bits_quantizes_only_the_global_layers(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny, kv_bits=4, kv_group_size=32)
    assert [l.kv_bits for l in spec.layers] == [None, 4, None, 4]
    assert spec.quantized and spec.layers[1].cache_kind == "QuantizedKVCache"


def test_gemma3_12b_geometry_comes_from_its_config_alone():
    spec = ModelCacheSpec.from_config(GEMMA3_12B)
    globals_ = [i for i, l in enumerate(spec.layers) if l.kind == GLOBAL]
    assert spec.n_layers == 48 and globals_ == [5, 11, 17, 23, 29, 35, 41, 47]
    assert all(l.window == 1024 for l in spec.layers if l.kind == SLIDING)
    assert (spec.n_kv_heads, spec.head_dim, spec.dtype) == (8, 256, "bfloat16")
    assert spec.layers[0].token_bytes() == 8 * 512 * 2  # K and V, bf16


def test_a_config_without_sliding_window_is_all_global():
    spec = ModelCacheSpec.from_config(
        {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576},
        dtype="float32",
    )
    assert spec.n_layers == 30 and spec.head_dim == 64 and {l.kind for l in spec.layers} == {GLOBAL}


def test_layer_specs_refuse_impossible_geometry():
    with pytest.raises(ValueError, match="kind"):
        LayerSpec("local", 1, 32, 32, "float32")
    with pytest.raises(ValueError, match="window"):
        LayerSpec(SLIDING, 1, 32, 32, "float32")
    with pytest.raises(UnsupportedCacheError, match="RotatingKVCache"):
        LayerSpec(SLIDING, 1, 32, 32, "float32", window=8, kv_bits=4, kv_group_size=32)
    with pytest.raises(ValueError, match="quantization"):
        LayerSpec(GLOBAL, 1, 32, 32, "float32", kv_bits=7, kv_group_size=32)
    with pytest.raises(ValueError, match="dtype"):
        LayerSpec(GLOBAL, 1, 32, 32, "int8")


def test_specs_round_trip_through_dicts_and_name_the_first_difference(llama_tiny, gemma_tiny):
    a = ModelCacheSpec.from_model(gemma_tiny)
    assert ModelCacheSpec.from_dict(a.to_dict()) == a
    assert a.fingerprint() == ModelCacheSpec.from_dict(a.to_dict()).fingerprint()
    b = ModelCacheSpec.from_model(llama_tiny)
    with pytest.raises(CacheMismatchError, match="layer 0"):
        a.require_same(b)
    with pytest.raises(CacheMismatchError, match="not a cache spec"):
        ModelCacheSpec.from_dict({"layers": [{"kind": "global"}]})
