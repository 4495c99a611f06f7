"""Budgets from the machine and the model (``semantic.sizing``), on stated machine sizes."""

from __future__ import annotations

from semantic import sizing
from semantic.cache import room
from semantic.cache.spec import LayerSpec, ModelCacheSpec
from semantic.modelconfig import ModelConfig

GiB = 1 << 30
QWEN3_CODER_30B = ModelCacheSpec(tuple(LayerSpec("global", 4, 128, 128, "bfloat16") for _ in range(48)))
GEMMA3_12B = ModelCacheSpec(tuple(
    LayerSpec("global" if i % 6 == 5 else "sliding", 8, 256, 256, "bfloat16", window=None if i % 6 == 5 else 1024)
    for i in range(48)))


def _derive(spec, memory_gib, *, weights=0, context=262_144, share=sizing.Share(), disk_gib=68):
    machine = sizing.Machine(memory_gib * GiB, 24 * GiB, "stated")
    config = ModelConfig.from_dict({"num_attention_heads": 32, "vocab_size": 151_936, "max_position_embeddings": context})
    return sizing.derive(spec, config, weights=weights, machine=machine, disk_free_bytes=disk_gib * GiB, share=share)


def test_a_24_gb_machine_holds_far_more_than_the_old_fixed_pool_at_qwen3_coder_geometry():
    b = _derive(QWEN3_CODER_30B, 22)
    assert b.reserve == 3 * GiB                            # max(3 GiB, 5% of 24 GiB)
    assert b.longest > 10_496 * 7                          # the old 1024 MB default: 10,496 tokens
    assert room.cache_bytes(QWEN3_CODER_30B, b.longest, 256) <= b.pool
    # the pool and its caches' live copies, the fixed costs and the working memory fit what is left
    assert (1 + sizing.LIVE_COPY) * b.pool + b.fixed + b.working <= 22 * GiB - b.reserve
    assert b.ram == int(b.pool * 0.75) and b.disk == int(68 * GiB / 4)


def test_a_bigger_machine_serves_the_full_default_context_and_counts_agents_at_a_typical_length():
    b = _derive(QWEN3_CODER_30B, 60)
    assert b.longest >= sizing.DEFAULT_LONGEST
    assert b.typical == sizing.TYPICAL_AGENT
    assert b.agents == b.pool // room.cache_bytes(QWEN3_CODER_30B, sizing.TYPICAL_AGENT, 256)
    assert "one agent of" in b.describe() and "reserve" in b.describe()


def test_weights_come_out_of_the_pool_and_a_model_of_shorter_context_is_sized_for_it():
    light, heavy = _derive(QWEN3_CODER_30B, 22), _derive(QWEN3_CODER_30B, 22, weights=8 * GiB)
    assert heavy.pool < light.pool - 3 * GiB  # the rest of them was the caches' live copies
    assert _derive(QWEN3_CODER_30B, 60, context=32_768).longest == 32_768


def test_sliding_windows_cost_only_their_global_layers_per_token():
    gemma, coder = _derive(GEMMA3_12B, 22), _derive(QWEN3_CODER_30B, 22)
    per_token = lambda spec: room.block_costs(spec, 256)["global"] / 256
    assert per_token(GEMMA3_12B) < per_token(QWEN3_CODER_30B)  # 8 global layers of 8 x 256 vs 48 of 4 x 128
    assert gemma.longest > coder.longest


def test_several_models_share_the_budget_and_each_counts_the_others_fixed_bytes():
    one = _derive(QWEN3_CODER_30B, 22, share=sizing.Share(memory=8 * GiB))
    two = _derive(QWEN3_CODER_30B, 22, share=sizing.Share(memory=8 * GiB, models=2, others_fixed=GiB))
    assert one.reserve == 0  # --models-mb is the budget as given
    assert 2 * two.pool < one.pool


def test_too_little_memory_gives_no_pool_rather_than_a_negative_one():
    b = _derive(QWEN3_CODER_30B, 3)
    assert b.pool == 0 and b.longest == 0


def test_the_machine_is_read_from_this_system():
    m = sizing.Machine.read()
    assert 0 < m.memory <= m.total and m.source
    assert sizing.disk_free("/nonexistent/child/of/root") > 0  # the nearest existing parent's filesystem


def test_a_short_context_model_counts_its_agents_at_its_own_longest_cache():
    b = _derive(QWEN3_CODER_30B, 22, context=8192)
    assert b.longest == b.typical == 8192 and b.agents >= 1
