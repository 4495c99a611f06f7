"""Synthetic caches in real geometries: random K/V in the shapes a model's cache really has.

Copying and hashing cost do not depend on values, so the timing kinds fill
real cache geometries (from a model config, no weights) with random tensors.
"""

from __future__ import annotations

import mlx.core as mx

from semantic import BlockPool, ModelCacheSpec, kinds
from semantic.cache import convert

SMOLLM2_135M = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "torch_dtype": "bfloat16",
}
GEMMA3_12B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 48,
    "hidden_size": 3840,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}


def live_caches(spec: ModelCacheSpec, tokens: int, seed: int = 0) -> list:
    """mlx-lm caches holding ``tokens`` tokens of random K/V (sliding layers: the last window)."""
    key = mx.random.key(seed)
    out = []
    for i, layer in enumerate(spec.layers):
        held = layer.tokens_held(tokens)
        k1, k2 = mx.random.split(mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.key(seed * 1000 + i))
        shape = (1, layer.n_kv_heads, held, layer.head_dim)
        k = mx.random.normal(shape, key=k1).astype(layer.mx_dtype)
        v = mx.random.normal(shape, key=k2).astype(layer.mx_dtype)
        out.append(kinds.of(layer).build(i, layer, k, v, tokens, held))
        mx.eval(k, v)
    return out


def synthetic_blocks(spec: ModelCacheSpec, tokens: int, seed: int = 0):
    """A pool and, in it, a cache of ``tokens`` random tokens in ``spec``'s geometry (see ``live_caches``)."""
    pool = BlockPool(spec, total_blocks=2 * (tokens // 256 + 2))
    return pool, convert.extract(pool, live_caches(spec, tokens, seed), range(tokens))
