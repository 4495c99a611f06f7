"""Random-weight models at real small hybrid geometries, as directories ``mlx_lm.load`` reads.

Speed does not depend on the weights, so a random model at a real geometry times what the real one
would; the tokenizer and chat template are SmolLM2's (a real BPE tokenizer, ChatML template), and the
vocabulary is set to its 49,152 ids (every id the model can emit decodes; LFM2's own is 65,536). The rows
of whole words in the output matrix are drawn larger (:data:`WORD_SCALE`), so replies echo back exactly.

    GEOMETRIES["lfm2-350m"]    LiquidAI/LFM2-350M's config: hidden 1024, 16 layers (10 short-conv, attention
                               at 2 5 8 10 12 14), 16 heads, 8 KV heads, conv L=3, ff 6656 auto-adjusted (4608)
    GEOMETRIES["gpt-oss-small"] gpt_oss's layer pattern (sliding 128 / full alternating) at a small width:
                               hidden 512, 8 layers, 8 heads of 64, 2 KV heads, 4 experts (2 active)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FA, SW = "full_attention", "sliding_attention"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SMOLLM2_VOCAB = 49152
FORMAT = 3  # bump when a geometry or the weights' recipe changes: the directory is rebuilt

LFM2_LAYERS = ["conv", "conv", FA, "conv", "conv", FA, "conv", "conv", FA, "conv", FA, "conv", FA, "conv", FA, "conv"]

GEOMETRIES: dict[str, dict] = {
    "lfm2-350m": {
        "model_type": "lfm2", "vocab_size": SMOLLM2_VOCAB, "hidden_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 128000,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 1024, "block_ff_dim": 6656,
        "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "rope_theta": 1000000.0, "layer_types": LFM2_LAYERS, "tie_word_embeddings": True,
    },
    "gpt-oss-small": {
        "model_type": "gpt_oss", "vocab_size": SMOLLM2_VOCAB, "hidden_size": 512, "num_hidden_layers": 8,
        "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128, "rope_theta": 150000.0,
        "rms_norm_eps": 1e-5, "layer_types": [SW, FA] * 4, "max_position_embeddings": 131072,
        "rope_scaling": None,
    },
}


# Rows of the output matrix (the tied embedding on LFM2) of whole lowercase words ("Ġharbour") are drawn
# this much larger, so a greedy reply is a run of such words: its text tokenizes back into the very ids
# generated (a byte-level BPE splits " word word" at each space), as a real model's prose mostly does.
# Without it a random model's reply is subword debris that retokenizes differently, and every server's
# cache is cut where the client echoes it back: a fact of random weights, not of the servers.
WORD_SCALE = 4.0


def word_ids(tokenizer_dir: Path | str, vocab: int) -> list[int]:
    """Ids of the tokenizer's whole lowercase words with a leading space (at least 3 letters)."""
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    word = re.compile(r"^\u0120[a-z]{3,}$")
    return sorted(i for t, i in tok.get_vocab().items() if i < vocab and word.match(t))


# The detokenizer trims the space of a reply's first token (" gross" streams as "gross"), as it does for
# every byte-level BPE model; a real model's first token rarely has one, these replies' always does. The
# template gives it back when it renders a reply (an SPM tokenizer's prefix space does the same), so a
# reply the client echoes renders into the ids that were generated, on every server alike.
REPLY = "message['content']"
SPACE_LED_REPLY = "(' ' + message['content'] if message['role'] == 'assistant' else message['content'])"


def _space_led_replies(config_path: Path) -> None:
    doc = json.loads(config_path.read_text())
    template = doc.get("chat_template") or ""
    if REPLY not in template:
        raise ValueError(f"{config_path}: no {REPLY} in the chat template to give replies their space back")
    doc["chat_template"] = template.replace(REPLY, SPACE_LED_REPLY, 1)
    config_path.write_text(json.dumps(doc, indent=1))


def layer_counts(config: dict) -> dict[str, int]:
    """How many layers of each type a geometry has (``layer_types``)."""
    out: dict[str, int] = {}
    for t in config.get("layer_types", []):
        out[t] = out.get(t, 0) + 1
    return out


def write_model(name: str, path: Path | str, tokenizer_dir: Path | str, seed: int = 0) -> Path:
    """``path`` as a model directory of geometry ``name``: config, seeded N(0, 0.02²) float32 matrices
    (norms and the model's own constants kept), SmolLM2's tokenizer files. Skipped when ``path`` already
    holds this geometry at this :data:`FORMAT`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path, config = Path(path), dict(GEOMETRIES[name])
    stamp = {"geometry": name, "format": FORMAT, "seed": seed, "config": config}
    marker = path / "hybrid-model.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp and (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating) and v.ndim >= 2:
            v = mx.random.normal(v.shape) * 0.02
        weights[k] = v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        mx.eval(weights[k])
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    rows = word_ids(tokenizer_dir, config["vocab_size"])
    scale = mx.ones((config["vocab_size"], 1)).at[mx.array(rows)].multiply(WORD_SCALE)
    weights[head] = weights[head] * scale
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / f
        if src.exists():
            shutil.copyfile(src, path / f)
    _space_led_replies(path / "tokenizer_config.json")
    marker.write_text(json.dumps(stamp, indent=1))
    return path


def default_dir(name: str) -> Path:
    """Where the run keeps a geometry's directory (beside the prepared models)."""
    from harness.models.store import cache_root

    return cache_root() / "models" / f"hybrid-{name}-f32"
