"""Tiny random-weight models built in-process: unit tests and the stress experiment.

Both use the real mlx-lm model classes, so their caches are the real
``KVCache`` / ``RotatingKVCache`` objects that ``make_prompt_cache`` returns.
Seeded, so the same name gives the same weights in every process.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, gpt_oss, lfm2, llama, qwen3_next

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


def tiny_llama(seed: int = 0, layers: int = 3, **shape):
    """A llama-architecture model: every layer a plain ``KVCache``; ``shape`` overrides :data:`LLAMA_CONFIG`
    (``hidden_size=512``: a model of tens of MB, whose memory a test can see)."""
    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict({**LLAMA_CONFIG, **shape, "num_hidden_layers": layers})
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


def tiny_qwen3_next(seed: int = 0, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    """A qwen3_next model (Qwen3-Next / Qwen3-Coder-Next's hybrid): Gated-DeltaNet layers
    (``ArraysCache`` of conv and SSM state) alternating with attention ones, MoE MLPs."""
    mx.random.seed(seed)
    args = qwen3_next.ModelArgs.from_dict(dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=heads, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=kv_heads, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=4096, head_dim=head_dim, full_attention_interval=2))
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_lfm2(seed: int = 0):
    """An lfm2 model: short-convolution layers (``ArraysCache`` of one array) beside attention ones."""
    mx.random.seed(seed)
    args = lfm2.ModelArgs.from_dict(dict(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=64, block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, full_attn_idxs=[1, 3], rope_theta=10000.0))
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gpt_oss(seed: int = 0, window: int = 8):
    """A gpt_oss model: sliding layers (``RotatingKVCache(window)``, attention sinks) alternating with
    global ones; a window under the pool's block is what real gpt-oss (128 under 256) has."""
    mx.random.seed(seed)
    args = gpt_oss.ModelArgs.from_dict(dict(
        model_type="gpt_oss", num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2))
    model = gpt_oss.Model(args)
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


def _byte_to_char(b: int) -> str:
    """The byte-level alphabet's character for byte ``b`` (GPT-2's bytes_to_unicode)."""
    return next(ch for ch in pre_tokenizers_alphabet() if _byte_of(ch) == b)


def pre_tokenizers_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in bs:
        return ord(ch)
    extra = [b for b in range(256) if b not in bs]
    return extra[ord(ch) - 256]


def write_tiny_llama(path, seed: int = 0, layers: int = 3, **shape):
    """A directory ``mlx_lm.load`` reads: the tiny llama's config (``shape`` over :data:`LLAMA_CONFIG`),
    weights and byte tokenizer (with :data:`CHAT_TEMPLATE`). Servers under test load it."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(seed, layers, **shape)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **shape, "num_hidden_layers": layers}, indent=1))
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
