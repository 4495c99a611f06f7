"""GGUF -> MLX repacking is exact for every block type it keeps quantized."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from harness.models.gguf.convert import (
    GGUFConversionError,
    module_path,
    pack_bits,
    repack_affine,
)

pytestmark = pytest.mark.compat


def _random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid raw blocks: random quants, finite f16 d / dmin."""
    rng = np.random.default_rng(seed)
    elems, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // elems
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, size=(n, 2)).astype(np.float16)
    raw[:, 0:2] = d[:, :1].view(np.uint8)
    if qtype in (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K):
        raw[:, 2:4] = (d[:, 1:] * np.float16(0.5)).view(np.uint8)  # m or dmin
    raw[: max(1, n // 50), 0:2] = 0  # some all-zero scales, as real files have
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_matches_mlx_quantize_layout(bits):
    w = mx.random.normal((8, 128), key=mx.random.key(bits))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    back = mx.dequantize(wq, scales, biases, group_size=32, bits=bits)
    g = np.array(back).reshape(8, 4, 32)
    q = np.rint((g - np.array(biases)[..., None]) / np.array(scales)[..., None]).reshape(8, 128)
    assert np.array_equal(pack_bits(q.astype(np.uint32), bits), np.array(wq))


@pytest.mark.parametrize(
    "qtype,bits",
    [(QT.Q4_0, 4), (QT.Q4_1, 4), (QT.Q5_0, 5), (QT.Q5_1, 5), (QT.Q8_0, 8), (QT.Q4_K, 4), (QT.Q5_K, 5)],
)
def test_repack_reproduces_ggufs_own_dequantization(qtype, bits):
    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, seed=bits)
    out = repack_affine(qtype, raw, (rows, cols))
    assert out.bits == bits
    assert out.arrays["weight"].dtype == np.uint32
    assert out.arrays["weight"].shape == (rows, cols * bits // 32)
    assert out.arrays["scales"].shape == (rows, cols // 32)
    ours = mx.dequantize(
        mx.array(out.arrays["weight"]),
        mx.array(out.arrays["scales"]),
        mx.array(out.arrays["biases"]),
        group_size=32,
        bits=bits,
    )
    ref = dequantize(raw, qtype).reshape(rows, cols)
    np.testing.assert_allclose(np.array(ours), ref, rtol=1e-6, atol=1e-7)


def test_tensor_names_map_to_mlx_lm_module_paths():
    assert module_path("llama", "blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj"
    assert module_path("llama", "blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm"
    assert module_path("gemma3", "blk.0.ffn_norm.weight") == "model.layers.0.pre_feedforward_layernorm"
    assert module_path("gemma3", "blk.3.post_ffw_norm.weight") == "model.layers.3.post_feedforward_layernorm"
    assert module_path("gemma3", "token_embd.weight") == "model.embed_tokens"
    with pytest.raises(GGUFConversionError, match="blk.0.mystery"):
        module_path("llama", "blk.0.mystery.weight")
