"""A model's config read one way (``semantic.modelconfig``): the text model's values over a wrapper's."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

from semantic.modelconfig import DEFAULT_CONTEXT, ModelConfig


def test_the_context_is_the_config_s_or_its_text_config_s():
    assert ModelConfig.of_model(NS(args=NS(max_position_embeddings=131072))).context == 131072
    # a multimodal wrapper (Qwen3.5, Gemma 3): mlx-lm keeps the text model's config as a dict
    wrapped = NS(args=NS(model_type="qwen3_5", text_config={"max_position_embeddings": 262144}))
    assert ModelConfig.of_model(wrapped).context == 262144
    assert ModelConfig.of_model(NS(args=NS(model_type="x", text_config={}))).context == DEFAULT_CONTEXT
    assert ModelConfig.of_model(NS()).context == DEFAULT_CONTEXT


def test_a_text_config_wins_over_the_top_level_for_every_reader(tmp_path):
    doc = {"vocab_size": 1000, "num_attention_heads": 8, "hidden_size": 256, "max_position_embeddings": 2048,
           "text_config": {"vocab_size": 262144, "max_position_embeddings": 131072, "num_key_value_heads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    for config in (ModelConfig.from_dict(doc), ModelConfig.read(tmp_path), ModelConfig.of_model(NS(args=doc))):
        assert (config.vocab, config.context, config.heads, config.kv_heads, config.head_dim) == (262144, 131072, 8, 2, 32)


def test_an_unreadable_config_is_none_and_missing_values_are_none():
    assert ModelConfig.read(__import__("pathlib").Path("/nonexistent")) is None
    empty = ModelConfig.from_dict({})
    assert (empty.layers, empty.vocab, empty.head_dim, empty.intermediate) == (None, None, None, None)
    assert ModelConfig.from_dict({"num_attention_heads": 4}).kv_heads == 4  # no KV heads named: one per query head
