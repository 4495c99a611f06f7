"""Tiny random-weight models built in-process, for fast unit tests.

Both use the real mlx-lm model classes, so their caches are the real
``KVCache`` / ``RotatingKVCache`` objects that ``make_prompt_cache`` returns.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama

VOCAB = 256


def tiny_llama(seed: int = 0, layers: int = 3):
    """A llama-architecture model: every layer a plain ``KVCache``."""
    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 128,  # head_dim 32: the smallest QuantizedKVCache group
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": VOCAB,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(seed: int = 0, layers: int = 4, window: int = 8):
    """A gemma3_text model: sliding layers (``RotatingKVCache``, window ``window``)
    alternating with global ones, so short prompts already wrap the ring buffer."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs.from_dict(
        {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "head_dim": 32,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "sliding_window": window,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 32,
        }
    )
    model = gemma3_text.Model(args)
    model.sanitize({})  # no lm_head weight: tie the output to the embedding
    mx.eval(model.parameters())
    return model
