"""Attention on the CPU with its softmax in base 2, over blocks of query rows: the same function, faster there.

MLX's CPU backend has no fused attention: ``mx.fast.scaled_dot_product_attention`` runs its fallback
(the scores, the mask, a softmax, the values) over the whole ``L x S`` of scores at once. On x86 MLX's
``exp`` runs at 13-17 ns an element (ml-explore/mlx#3019: no x86 SIMD) where ``power`` runs at about 5,
and a long prompt's scores are tens of MB an array, faulted in and streamed through once per step. For
float32 queries, keys and values on the CPU this module computes the fallback's steps with the scale
times log2(e) and ``mx.power(2, .)`` for ``exp`` (the same softmax, rounded differently in the last
bits), a block of query rows at a time (:data:`BLOCK_ELEMENTS`). SmolLM2, 2 cores: a 35-token pass over
548 cached tokens 0.27 s -> 0.24 s, an 830-token prompt in one pass 4.8-6.1 s -> 3.7-4.0 s, 1,500 tokens
14 s -> 7.3-7.8 s. Anything else (another dtype, a GPU, attention sinks, an additive mask, an explicit stream)
goes to MLX's own, unchanged.

:func:`install` puts it in place of ``mx.fast.scaled_dot_product_attention`` for this process (mlx-lm's
models call it there); the executor installs it. ``SEMANTIC_CPU_ATTENTION=off`` keeps MLX's (and with it,
batches merge their rows: a row-wise batch's keys, ``kinds.rows.RowKV``, are attended row by row here).
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from semantic.kinds.rows import RowKV, attend

ENV = "SEMANTIC_CPU_ATTENTION"
LOG2E = 1.0 / math.log(2.0)
_FLOOR = mx.array(float(mx.finfo(mx.float32).min), mx.float32)
_TWO = mx.array(2.0, mx.float32)
# scores a block of query rows holds at most (4 MB of float32): 512K-2M measured alike here, the whole
# L x S of a 2K-token prefill 2.8x slower (739 ms a layer against 261)
BLOCK_ELEMENTS = 1 << 20

_mlx_sdpa = mx.fast.scaled_dot_product_attention


def install() -> bool:
    """Make :func:`attention` this process's ``mx.fast.scaled_dot_product_attention`` (once); False when
    ``SEMANTIC_CPU_ATTENTION=off`` keeps MLX's."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    mx.fast.scaled_dot_product_attention = attention
    return True


def uninstall() -> None:
    mx.fast.scaled_dot_product_attention = _mlx_sdpa


def installed() -> bool:
    return mx.fast.scaled_dot_product_attention is attention


def handles(q: mx.array, k: mx.array, v: mx.array, mask, sinks, kwargs: dict) -> bool:
    """Whether :func:`attention` computes this call itself (else MLX's does)."""
    if sinks is not None or kwargs or mx.default_device() != mx.cpu:
        return False
    if not (q.dtype == k.dtype == v.dtype == mx.float32) or q.ndim != 4 or k.ndim != 4:
        return False
    if q.shape[1] % k.shape[1]:
        return False
    if isinstance(mask, str):  # more queries than keys: MLX versions differ on where that mask starts
        return mask == "causal" and q.shape[2] <= k.shape[2]
    return mask is None or (mask.dtype == mx.bool_ and mask.ndim <= 4)


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None, **kwargs) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``'s result, its softmax in base 2 where :func:`handles` says.

    The queries go in blocks of rows whose scores hold about :data:`BLOCK_ELEMENTS`: each step's
    intermediates stay a few MB (MLX's fallback makes the whole ``L x S`` at once, and the CPU spends its
    time faulting in and streaming those), and under a causal mask a block attends only to the keys up to
    its last row (the rest would be masked whole: the fallback computes them, and they add exactly 0).
    """
    if isinstance(k, RowKV):  # a row-wise batch (kinds.rows): each row over its own keys, by this function
        return attend(q, k, v, attention, scale=scale, mask=mask, sinks=sinks, **kwargs)
    if not handles(q, k, v, mask, sinks, kwargs):
        return _mlx_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    B, H, L, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    q = q * mx.array(scale * LOG2E, mx.float32)  # scores in base 2: exp(x) = 2 ** (x log2 e)
    if G > 1:  # the fallback's grouping: the query heads that share a KV head, no copy of K or V
        q = q.reshape(B, KV, G, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    causal = isinstance(mask, str)
    off = S - L  # the fallback's causal offset: the last query sees every key
    rows = max(1, min(L, BLOCK_ELEMENTS // (B * H * S)))
    outs = []
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        if causal:
            end = min(S, off + r1)
            kb, vb, m = k[..., :end, :], v[..., :end, :], mx.arange(off + r0, off + r1)[:, None] >= mx.arange(end)[None]
        else:
            kb, vb, m = k, v, _rows(mask, r0, r1, L, KV, G)
        scores = (q[..., r0:r1, :] if rows < L else q) @ kb.swapaxes(-1, -2)
        if m is not None:  # the fallback's finite floor: a row masked whole comes out uniform, as MLX's does
            scores = mx.where(m, scores, _FLOOR)
        e = mx.power(_TWO, scores - mx.max(scores, axis=-1, keepdims=True))
        # normalized before the values, as the fallback does: dividing the L x D output instead was as exact
        # against float64 but moved an 8-bit KV cache's quantization across its buckets 3x the noise apart
        outs.append((e / mx.sum(e, axis=-1, keepdims=True)) @ vb)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-2)
    return out.reshape(B, H, L, out.shape[-1]) if G > 1 else out


def _rows(mask, r0: int, r1: int, L: int, KV: int, G: int):
    """A boolean mask's part for query rows ``[r0, r1)``, grouped as the scores are (None stays None)."""
    if mask is None:
        return None
    if mask.ndim >= 2 and mask.shape[-2] == L and (r0, r1) != (0, L):
        mask = mask[..., r0:r1, :]
    if G > 1 and mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(*mask.shape[:-3], KV, G, *mask.shape[-2:])
    return mask
