"""What a model costs a server's RSS before it loads (``semantic.serve.fleet.footprint``), from its files alone:
weights, pool, a turn's working memory, the tokenizer it keeps. The constants are measured elsewhere
(``harness/memory/costs.py``); these pin what the estimate is made of."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from semantic.serve.fleet import footprint as fp

MB = 1 << 20
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
         "max_position_embeddings": 4096}


def _model(tmp_path: Path, config: dict, dtype: str = "F32", weights: int = 1000, tokenizer: int = 0,
           name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": dtype, "shape": [weights // 4], "data_offsets": [0, weights]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(weights))
    if tokenizer:
        (d / "tokenizer.json").write_bytes(b" " * tokenizer)
    return d


def test_a_model_counts_its_weight_files_its_pool_and_a_turns_working_memory_and_keeps_its_tokenizer(tmp_path):
    d = _model(tmp_path, LLAMA, tokenizer=MB)
    f = fp.footprint(d, 8 * MB)
    assert f.weights == (d / "model.safetensors").stat().st_size and f.pool == 8 * MB
    assert f.tokenizer == fp.TOKENIZER_FIXED + fp.TOKENIZER_PER_FILE_BYTE * MB
    assert f.loaded == f.weights + f.pool + f.working  # what an unload gives back: not the tokenizer

    # token bytes 2 layers x K and V x 2 heads x 16 x 4 B = 512: the pool holds 16384 tokens, the context 4096
    live = int(fp.LIVE_COPY * min(8 * MB, 8 * 4096 * 512))  # the live caches, as measured against the pool
    logits, scores = 8 * 9 * 1000 * 4, 4 * 2048 * 4096 * 4  # a decode step's 8 rows of 9 positions
    activations = 2048 * (3 * 128 + 4 * 64) * 4
    assert f.working == live + max(logits, scores) + activations + fp.MLX_CACHE_BYTES


def test_the_working_memory_follows_the_longest_prompt_the_pool_holds_and_the_prefill_chunk(tmp_path):
    d = _model(tmp_path, LLAMA)
    small, large = fp.working_bytes(d, 1 * MB), fp.working_bytes(d, 64 * MB)
    assert small < large  # a larger pool holds a longer prompt: its attention scores and its live cache
    assert fp.working_bytes(d, 64 * MB, chunk=64) < large  # a fixed, smaller chunk: smaller scores


def test_a_sliding_window_model_prefills_like_any_other_and_half_width_activations_halve_the_cache(tmp_path):
    windowed = _model(tmp_path, {**LLAMA, "sliding_window": 512}, name="windowed")
    assert fp.working_bytes(windowed, 8 * MB) == fp.working_bytes(_model(tmp_path, LLAMA, name="global"), 8 * MB)
    large_vocab = _model(tmp_path, {**LLAMA, "vocab_size": 262144}, name="vocab")
    # a prompt's last chunk computes one row of logits: a decode step's 72 rows (75 MB) stay below a chunk's scores
    assert fp.working_bytes(large_vocab, 8 * MB) == fp.working_bytes(windowed, 8 * MB)
    f32, bf16 = _model(tmp_path, LLAMA, name="f32"), _model(tmp_path, LLAMA, dtype="BF16", name="bf16")
    assert fp.working_bytes(bf16, 64 * MB) < fp.working_bytes(f32, 64 * MB)  # a token's cache is half as large


def test_a_hub_id_or_a_config_that_says_too_little_counts_what_is_known(tmp_path):
    assert fp.footprint(Path("org/some-model"), 8 * MB) == fp.Footprint(0, 8 * MB, 0, 0)
    d = _model(tmp_path, {"model_type": "mystery"})
    assert fp.working_bytes(d, 8 * MB) == 8 * MB + fp.MLX_CACHE_BYTES
