"""Attention on the CPU with its softmax in base 2: the same function, 12-18% off a forward pass there.

MLX's CPU backend has no fused attention: ``mx.fast.scaled_dot_product_attention`` runs its fallback
(the scores, the mask, a softmax, the values). On x86 MLX's ``exp`` runs at 13-17 ns an element
(ml-explore/mlx#3019: no x86 SIMD) where ``power`` runs at about 5, so the softmax is most of
attention's time: a 35-token pass of SmolLM2 over 548 cached tokens 0.27 s -> 0.24 s, a 1.5K-token
prefill 14-15 s -> 12 s (float32, OpenBLAS, 2 cores). For float32 queries, keys and values on the
CPU this module computes the fallback's steps with the scale times log2(e) and ``mx.power(2, .)``
for ``exp``: the same softmax, rounded differently in the last bits. Anything else (another dtype, a
GPU, attention sinks, an additive mask, an explicit stream) goes to MLX's own, unchanged.

:func:`install` puts it in place of ``mx.fast.scaled_dot_product_attention`` for this process (mlx-lm's
models call it there); the engine installs it when it loads a model. ``SEMANTIC_CPU_ATTENTION=off``
keeps MLX's.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

ENV = "SEMANTIC_CPU_ATTENTION"
LOG2E = 1.0 / math.log(2.0)
_MIN = float(mx.finfo(mx.float32).min)

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
    if isinstance(mask, str):
        return mask == "causal"
    return mask is None or (mask.dtype == mx.bool_ and mask.ndim <= 4)


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None, **kwargs) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``'s result, its softmax in base 2 where :func:`handles` says."""
    if not handles(q, k, v, mask, sinks, kwargs):
        return _mlx_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    B, H, L, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    q = q * mx.array(scale * LOG2E, mx.float32)  # scores in base 2: exp(x) = 2 ** (x log2 e)
    if G > 1:  # the fallback's grouping: the query heads that share a KV head, no copy of K or V
        q = q.reshape(B, KV, G, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal", as the fallback builds it
        off = max(S - L, 0)
        mask = mx.arange(off, off + L)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if G > 1 and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(
                *mask.shape[:-3], KV, G, *mask.shape[-2:])
        # the fallback's finite floor: a row masked whole comes out uniform, as MLX's does, not NaN
        scores = mx.where(mask, scores, mx.array(_MIN, mx.float32))
    p = mx.power(mx.array(2.0, mx.float32), scores - mx.max(scores, axis=-1, keepdims=True))
    out = (p / mx.sum(p, axis=-1, keepdims=True)) @ v
    return out.reshape(B, H, L, out.shape[-1]) if G > 1 else out
