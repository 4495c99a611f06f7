"""Tiny random-weight models built in-process: unit tests and the stress experiment.

Both use the real mlx-lm model classes, so their caches are the real
``KVCache`` / ``RotatingKVCache`` objects that ``make_prompt_cache`` returns.
Seeded, so the same name gives the same weights in every process.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama

VOCAB = 256


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,  # head_dim 32: the smallest QuantizedKVCache group
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}

# a ChatML-like template, so chat requests render on the byte tokenizer
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama(seed: int = 0, layers: int = 3):
    """A llama-architecture model: every layer a plain ``KVCache``."""
    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict({**LLAMA_CONFIG, "num_hidden_layers": layers})
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


def byte_tokenizer():
    """A real mlx-lm TokenizerWrapper over a 256-symbol byte-level vocabulary,
    matching the tiny models' embedding size; byte 255 is the EOS token."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_char)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = byte_to_char[255]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    return TokenizerWrapper(hf, eos_token_ids=[255])


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in bs:
        return ord(ch)
    extra = [b for b in range(256) if b not in bs]
    return extra[ord(ch) - 256]


def write_tiny_llama(path, seed: int = 0, layers: int = 3):
    """A directory ``mlx_lm.load`` reads: the tiny llama's config, weights and
    byte tokenizer (with :data:`CHAT_TEMPLATE`). Servers under test load it."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(seed, layers)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "num_hidden_layers": layers}, indent=1))
    hf = byte_tokenizer()._tokenizer
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))
    return path


# The tiny tool-calling models: the byte tokenizer plus each format's markers as special tokens (as real
# models have them), under a template whose markers mlx-lm sniffs. Ids 256 and up; the vocabulary rounds up.
TOOL_FLAVOURS = {
    "hermes": ("hermes_tools.jinja", ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
               "<|im_end|>", None),
    "mistral": ("mistral_tools.jinja", ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]",
                                        "[/SYSTEM_PROMPT]"], "</s>", "<s>"),
    # not a tool format: a reasoning model whose replies open in a think block (mlx-lm finds the markers)
    "think": ("think.jinja", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None),
}


def write_tiny_tool_llama(path, flavour: str = "hermes", seed: int = 0, layers: int = 2):
    """A tiny llama directory whose chat template calls tools in ``flavour``'s native format
    (:data:`TOOL_FLAVOURS`: Qwen2.5's Hermes ``<tool_call>`` or Mistral's ``[TOOL_CALLS]``), or
    thinks (``think``: replies open in ``<think>``, and history drops old reasoning)."""
    import json
    from importlib import resources
    from pathlib import Path

    from mlx.utils import tree_flatten

    template_file, specials, eos, bos = TOOL_FLAVOURS[flavour]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = byte_tokenizer()._tokenizer
    hf.add_special_tokens({"additional_special_tokens": specials})
    hf.eos_token = eos
    if bos is not None:
        hf.bos_token = bos
    hf.chat_template = resources.files("harness.models").joinpath(f"chat_templates/{template_file}").read_text()
    vocab = -(-len(hf) // 16) * 16
    config = {**LLAMA_CONFIG, "num_hidden_layers": layers, "vocab_size": vocab,
              "eos_token_id": hf.convert_tokens_to_ids(eos)}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    hf.save_pretrained(str(path))
    return path
