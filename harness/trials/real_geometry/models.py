"""Tiny-body, random-weight models whose caches have real models' bytes per token.

A cache's bytes depend on the layers, the KV heads, the head dimension, the dtype, the windows and the
recurrent states' shapes; nothing else. Each geometry keeps those of a real model (from its config.json)
and makes everything else small (hidden 64, query heads = KV heads, a 128-wide MLP or 4 small experts,
the 256-id byte vocabulary of ``harness.models.tiny``), so a forward pass is cheap and the cache is the
real one. Weights are bfloat16, so the caches mlx-lm builds are too (the real checkpoints' dtype). The two
mixture-of-experts models are built as their dense siblings (``qwen3``, ``qwen3_5``: the same attention and
Gated DeltaNet layers, so the same caches), because MLX's CPU ``gather_mm`` computes float32 only::

    qwen3-coder-30b-a3b  qwen3        48 layers, 4 KV heads x 128, global                    96 KiB/token
    llama-3.1-8b         llama        32 layers, 8 KV heads x 128, global                   128 KiB/token
    gemma-3-12b          gemma3_text  48 layers, 8 KV heads x 256, window 1024, 1 global in 6: 64 KiB/token
                                      + 40 windows of 1024 tokens (320 MiB once the context passes 1024)
    qwen3.5-35b-a3b      qwen3_5      40 layers: 30 Gated DeltaNet + 10 attention (2 KV heads x 256):
                                      20 KiB/token + a ~63 MB recurrent snapshot (harness.trials.hybrid.sizes)

Directories are written once under ``~/.cache/semantic-kv/models/real-geometry-<name>`` (a marker
holds the recipe; a changed recipe rebuilds) and loaded by the real ``mlx_lm.load``.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = 1  # bump when a geometry or the weights' recipe changes: the directory is rebuilt

TINY = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _qwen35_text() -> dict:
    from harness.trials.hybrid.sizes import BIG

    big = BIG["qwen3.5-35b-a3b"]
    keep = ("num_hidden_layers", "full_attention_interval", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
    return {"model_type": "qwen3_5_text", **TINY, **{k: big[k] for k in keep},
            "num_attention_heads": big["num_key_value_heads"], "max_position_embeddings": 262144,
            "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25}}


# name -> (the real model it stands for, its config with a tiny body, the real cache's numbers)
GEOMETRIES: dict[str, dict] = {
    "qwen3-coder-30b-a3b": {
        "real": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        "config": {"model_type": "qwen3", **TINY, "num_hidden_layers": 48, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 262144,
                   "rope_theta": 10000000.0},
        "kv_bytes_per_token": 48 * 4 * 128 * 2 * 2,
    },
    "llama-3.1-8b": {
        "real": "meta-llama/Llama-3.1-8B-Instruct",
        "config": {"model_type": "llama", **TINY, "num_hidden_layers": 32, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                   "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        "kv_bytes_per_token": 32 * 8 * 128 * 2 * 2,
    },
    "gemma-3-12b": {
        "real": "google/gemma-3-12b-it",
        "config": {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 48, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "kv_bytes_per_token": 8 * 8 * 256 * 2 * 2,            # the global layers; the windows are fixed
        "window_bytes": 40 * 1024 * 8 * 256 * 2 * 2,
    },
    "qwen3.5-35b-a3b": {
        "real": "Qwen/Qwen3.5-35B-A3B",
        "config": {"model_type": "qwen3_5", "text_config": None, "tie_word_embeddings": False},
        "kv_bytes_per_token": 10 * 2 * 256 * 2 * 2,
        "hybrid": True,  # recurrent layers: a turn's goals are a hybrid's (report.CACHED_GOAL)
    },
}


def config_of(name: str) -> dict:
    cfg = json.loads(json.dumps(GEOMETRIES[name]["config"]))
    if name == "qwen3.5-35b-a3b":
        cfg["text_config"] = _qwen35_text()
    return cfg


def context_of(name: str) -> int:
    cfg = config_of(name)
    return (cfg.get("text_config") or cfg)["max_position_embeddings"]


def default_root() -> Path:
    from harness.models.store import cache_root

    return cache_root() / "models"


def model_dir(name: str, root: Path | str | None = None) -> Path:
    return Path(root or default_root()) / f"real-geometry-{name}"


def write_model(name: str, root: Path | str | None = None, seed: int = 0) -> Path:
    """The model directory of geometry ``name`` (written unless it already holds this recipe): config,
    seeded N(0, 0.02²) bfloat16 matrices (norms and the model's own constants kept, cast to bfloat16),
    the byte tokenizer with ``harness.models.tiny``'s chat template, end of turn byte 10."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from harness.models.tiny import CHAT_TEMPLATE, _byte_to_char, byte_tokenizer

    path, config = model_dir(name, root), config_of(name)
    stamp = {"geometry": name, "format": FORMAT, "seed": seed, "config": config}
    marker = path / "real-geometry.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp and (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(config))))
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            if v.ndim >= 2:
                v = mx.random.normal(v.shape) * 0.02
            v = v.astype(mx.bfloat16)
        weights[k] = v
        mx.eval(v)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 10}, indent=1))
    hf = byte_tokenizer()._tokenizer
    hf.eos_token = _byte_to_char(10)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))
    marker.write_text(json.dumps(stamp, indent=1))
    return path


def load_spec(path: Path):
    """(model, cache spec) as the server computes them: ``mlx_lm.load`` through ``semantic.compat``, then
    ``ModelCacheSpec.from_model``."""
    from semantic import compat
    from semantic.cache.spec import ModelCacheSpec

    model, _tok = compat.load(Path(path))
    return model, ModelCacheSpec.from_model(model)
