"""Convert a llama.cpp GGUF file into a standard MLX model directory.

The block quantizations llama.cpp uses for these models are affine per group
of 32 weights, which is exactly MLX's ``affine`` mode with ``group_size=32``:

    GGUF block            value                       MLX (bits, scale, bias)
    Q4_0                  d * (q - 8)                 (4, d,      -8 d)
    Q4_1                  d * q + m                   (4, d,       m)
    Q5_0                  d * (q - 16)                (5, d,     -16 d)
    Q5_1                  d * q + m                   (5, d,       m)
    Q8_0                  d * q,  q signed            (8, d,    -128 d)
    Q4_K / Q5_K           (d*sc_j) * q - dmin*m_j     (4|5, d*sc_j, -dmin*m_j)

so those tensors are repacked without loss and stay quantized. Q6_K uses
groups of 16, which MLX cannot express (group sizes 32, 64, 128), so those
tensors are dequantized exactly into float32 and left unquantized.
Every repacked tensor is checked against ``gguf``'s own dequantizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

from harness.models.gguf.tokenizer import write_tokenizer

GROUP = 32

# GGUF block types that map exactly onto MLX affine groups of 32, with their bit width
_AFFINE = {
    QT.Q4_0: 4,
    QT.Q4_1: 4,
    QT.Q5_0: 5,
    QT.Q5_1: 5,
    QT.Q8_0: 8,
    QT.Q4_K: 4,
    QT.Q5_K: 5,
}


class GGUFConversionError(RuntimeError):
    """The GGUF file cannot be turned into an MLX model directory."""


@dataclass(slots=True)
class ConvertedTensor:
    name: str
    arrays: dict[str, np.ndarray]  # weight (+ scales, biases when quantized)
    bits: int | None = None        # None: stored as float


@dataclass(slots=True)
class ConversionReport:
    out_dir: Path
    architecture: str
    quantized: dict[str, int] = field(default_factory=dict)  # module path -> bits
    dense: list[str] = field(default_factory=list)
    source_types: dict[str, int] = field(default_factory=dict)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)[..., 0]


def _scales_biases(qtype: QT, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32-group (scale, bias) of each block, shape (n_blocks, groups_per_block)."""
    d = _f16(blocks[:, 0:2])[:, None]
    if qtype in (QT.Q4_0,):
        return d, -8.0 * d
    if qtype in (QT.Q5_0,):
        return d, -16.0 * d
    if qtype == QT.Q8_0:
        return d, -128.0 * d
    if qtype in (QT.Q4_1, QT.Q5_1):
        return d, _f16(blocks[:, 2:4])[:, None]
    if qtype in (QT.Q4_K, QT.Q5_K):
        dmin = _f16(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        return d * sc.astype(np.float32), -dmin * m.astype(np.float32)
    raise AssertionError(qtype)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints of ``bits`` width into MLX's uint32 layout.

    MLX stores a row as one little-endian bit stream: weight j occupies bits
    [j*bits, (j+1)*bits) of the row, read as consecutive uint32 words.
    """
    rows, cols = q.shape
    assert (cols * bits) % 32 == 0, (cols, bits)
    if 32 % bits == 0:  # 2/4/8 bits: whole weights per word, no bit-level temporaries
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
        words = q.astype(np.uint32).reshape(rows, cols // per_word, per_word) << shifts
        return np.bitwise_or.reduce(words, axis=-1)
    shifts = np.arange(bits, dtype=np.uint32)
    stream = ((q.astype(np.uint32)[..., None] >> shifts) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little")
    return packed.view(np.uint32)


def repack_affine(qtype: QT, raw: np.ndarray, shape: tuple[int, int]) -> ConvertedTensor:
    """Repack one GGUF block-quantized matrix as MLX (weight, scales, biases)."""
    rows, cols = shape
    bits = _AFFINE[qtype]
    w = dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    scales, biases = _scales_biases(qtype, blocks)
    scales = scales.reshape(rows, cols // GROUP).astype(np.float32)
    biases = biases.reshape(rows, cols // GROUP).astype(np.float32)

    g = w.reshape(rows, cols // GROUP, GROUP)
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    q = np.rint((g - biases[..., None]) / safe)
    q = np.where(scales[..., None] == 0, 0, q)
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint32).reshape(rows, cols)

    packed = pack_bits(q, bits)
    back = mx.dequantize(
        mx.array(packed), mx.array(scales), mx.array(biases), group_size=GROUP, bits=bits
    )
    err = float(np.max(np.abs(np.array(back) - w)))
    tol = 1e-5 * max(1.0, float(np.max(np.abs(w))))
    if not err <= tol:
        raise GGUFConversionError(
            f"{qtype.name} repack is not exact: max abs error {err:.3g} > {tol:.3g}"
        )
    return ConvertedTensor("", {"weight": packed, "scales": scales, "biases": biases}, bits)


# GGUF tensor name (after "blk.N.") -> HF / mlx-lm module path
_PROJECTIONS = {  # attention and MLP projections, named alike in both architectures
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        **_PROJECTIONS,
    },
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        **_PROJECTIONS,
    },
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def module_path(arch: str, gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` (no suffix)."""
    base = gguf_name.removesuffix(".weight")
    if base.startswith("blk."):
        _, idx, rest = base.split(".", 2)
        try:
            return f"model.layers.{idx}.{_LAYER_NAMES[arch][rest]}"
        except KeyError:
            raise GGUFConversionError(f"unknown {arch} tensor {gguf_name!r}") from None
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base]
    raise GGUFConversionError(f"unknown {arch} tensor {gguf_name!r}")


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def model_config(reader: GGUFReader) -> dict:
    """The mlx-lm ``config.json`` (without quantization) for this GGUF."""
    arch = _field(reader, "general.architecture")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    common = {
        "hidden_size": int(g("embedding_length")),
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "max_position_embeddings": int(g("context_length")),
        "rope_theta": float(g("rope.freq_base")),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }
    if arch == "llama":
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            "head_dim": common["hidden_size"] // common["num_attention_heads"],
            # llama.cpp stores Q/K rows permuted for interleaved ("traditional") RoPE.
            "rope_traditional": True,
            "attention_bias": False,
            "mlp_bias": False,
        }
    if arch == "gemma3":
        head_dim = int(g("attention.key_length"))
        return {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            **common,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,  # llama.cpp scales by 1/sqrt(head_dim)
            "sliding_window": int(g("attention.sliding_window")),
            "sliding_window_pattern": 6,  # llama.cpp's fixed Gemma 3 pattern
            "rope_local_base_freq": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            # chat turns end with <end_of_turn>, plain text with <eos>
            "eos_token_id": _eos_ids(reader, common["eos_token_id"], "<end_of_turn>"),
        }
    raise GGUFConversionError(f"unsupported GGUF architecture {arch!r}")


def _eos_ids(reader: GGUFReader, eos: int, turn_end: str) -> list[int]:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return [eos] + [i for i, t in enumerate(tokens) if t == turn_end]


def convert_tensor(arch: str, tensor) -> ConvertedTensor:
    path = module_path(arch, tensor.name)
    qtype = QT(tensor.tensor_type)
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
    if qtype in _AFFINE and len(shape) == 2 and shape[1] % GROUP == 0:
        out = repack_affine(qtype, np.asarray(tensor.data), shape)
        out.name = path
        return out
    w = dequantize(np.asarray(tensor.data), qtype).astype(np.float32).reshape(shape)
    if arch == "gemma3" and path.endswith(("norm", "layernorm")):
        # convert_hf_to_gguf stores Gemma's RMSNorm weight as (1 + w); mlx-lm adds the 1.
        w = w - 1.0
    return ConvertedTensor(path, {"weight": w})


def convert(gguf_path: Path, out_dir: Path, chat_template: str | None = None) -> ConversionReport:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files to ``out_dir``."""
    reader = GGUFReader(str(gguf_path))
    config = model_config(reader)
    arch = _field(reader, "general.architecture")
    report = ConversionReport(out_dir=out_dir, architecture=arch)

    weights: dict[str, mx.array] = {}
    quant: dict[str, object] = {"group_size": GROUP, "bits": 4}
    for tensor in reader.tensors:
        ct = convert_tensor(arch, tensor)
        qname = QT(tensor.tensor_type).name
        report.source_types[qname] = report.source_types.get(qname, 0) + 1
        for suffix, arr in ct.arrays.items():
            weights[f"{ct.name}.{suffix}"] = mx.array(arr)
        if ct.bits is None:
            report.dense.append(ct.name)
            if ct.arrays["weight"].ndim == 2:
                quant[ct.name] = False  # a layer mlx-lm would otherwise try to quantize
        else:
            report.quantized[ct.name] = ct.bits
            quant[ct.name] = {"group_size": GROUP, "bits": ct.bits}
    config["quantization"] = quant
    config["quantization_config"] = quant

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(reader, out_dir, chat_template=chat_template)
    return report
