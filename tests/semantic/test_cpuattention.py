"""The CPU's base-2 attention: MLX's function, as close to the exact one as MLX's own, and MLX's where it does not apply."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from semantic import cpuattention
from tests.tiny_models import tiny_gemma3, tiny_llama


@pytest.fixture
def on_cpu():
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture
def mlx_attention():
    """MLX's own in place for the test (the executor installs ours for the process), put back after."""
    was = cpuattention.installed()
    cpuattention.uninstall()
    yield
    if was:
        cpuattention.install()


def _exact(q, k, v, scale, mask):
    """The attention in float64 (numpy): what both float32 computations are measured against."""
    q, k, v = (np.array(x, dtype=np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    L, S = q.shape[2], k.shape[2]
    m = (np.arange(S - L, S)[:, None] >= np.arange(S)[None]) if isinstance(mask, str) else (
        None if mask is None else np.array(mask))
    if m is not None:
        s = np.where(m, s, -1e300)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


SHAPES = [  # (batch, query heads, KV heads, queries, keys, head size)
    (1, 9, 3, 35, 548, 64),  # SmolLM2's sub-agent turn: 35 new tokens over 548
    (2, 8, 8, 1, 300, 32),  # a batched decode step, no grouping
    (1, 4, 2, 17, 17, 16),  # a prefill from nothing
    (3, 6, 2, 5, 40, 8),
]


def _masks(rng, B, H, L, S):
    yield None
    yield "causal"
    for shape in ((L, S), (B, 1, L, S), (B, H, L, S)):
        yield mx.array(rng.random(shape) > 0.3)


@pytest.mark.parametrize("block", [None, 1, 7], ids=["whole", "row-by-row", "blocks-of-7-rows"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_base_two_attention_is_as_close_to_the_exact_one_as_mlxs_own(shape, block, on_cpu, monkeypatch):
    B, H, KV, L, S, D = shape
    if block is not None:  # query rows in blocks: a causal block's keys end at its last row, a mask's rows sliced
        monkeypatch.setattr(cpuattention, "BLOCK_ELEMENTS", block * B * H * S)
    rng = np.random.default_rng(sum(shape))
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((B, H, L, D), (B, KV, S, D), (B, KV, S, D)))
    for mask in _masks(rng, B, H, L, S):
        assert cpuattention.handles(q, k, v, mask, None, {})
        exact = _exact(q, k, v, 0.3, mask)
        ours = np.abs(np.array(cpuattention.attention(q, k, v, scale=0.3, mask=mask)) - exact).max()
        theirs = np.abs(np.array(cpuattention._mlx_sdpa(q, k, v, scale=0.3, mask=mask)) - exact).max()
        # float32's rounding either way: within a few times MLX's own error (2e-7 to 3e-6 here), never worse
        assert ours <= max(4 * theirs, 2e-6), (mask if mask is None or isinstance(mask, str) else mask.shape, ours, theirs)


def test_a_row_masked_whole_comes_out_as_mlx_gives_it_uniform_not_nan(on_cpu):
    q, k = mx.ones((1, 2, 3, 4)), mx.ones((1, 1, 5, 4))
    v = mx.arange(20, dtype=mx.float32).reshape(1, 1, 5, 4)
    mask = mx.array(np.array([[0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], bool))
    ours = cpuattention.attention(q, k, v, scale=1.0, mask=mask)
    assert mx.allclose(ours, cpuattention._mlx_sdpa(q, k, v, scale=1.0, mask=mask)).item()
    assert mx.allclose(ours[0, 0, 0], mx.mean(v[0, 0], axis=0)).item()  # all five keys, equally


def test_other_dtypes_sinks_and_additive_masks_go_to_mlxs_attention_unchanged(on_cpu):
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 6, 8), (1, 2, 10, 8), (1, 2, 10, 8)))
    additive = mx.array(np.where(rng.random((6, 10)) > 0.3, 0.0, -1e9).astype(np.float32))
    sinks = mx.array(rng.standard_normal(4).astype(np.float32))
    cases = [
        ((q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16)), {"mask": "causal"}),
        ((q, k, v), {"mask": additive}),
        ((q, k, v), {"mask": "causal", "sinks": sinks}),
        ((q, k, v), {"mask": None, "stream": mx.cpu}),
        ((k, q[:, :2], q[:, :2]), {"mask": "causal"}),  # more queries than keys: MLX versions place it apart
    ]
    for args, kw in cases:
        assert not cpuattention.handles(*args, kw.get("mask"), kw.get("sinks"), {k: v for k, v in kw.items()
                                                                                if k not in ("mask", "sinks")})
        assert mx.array_equal(cpuattention.attention(*args, scale=0.5, **kw),
                              cpuattention._mlx_sdpa(*args, scale=0.5, **kw)).item()


def test_install_puts_it_where_mlx_lm_calls_attention_and_the_environment_keeps_mlxs(monkeypatch, mlx_attention):
    monkeypatch.setenv(cpuattention.ENV, "off")
    assert not cpuattention.install()
    assert mx.fast.scaled_dot_product_attention is cpuattention._mlx_sdpa
    monkeypatch.delenv(cpuattention.ENV)
    assert cpuattention.install() and cpuattention.installed()
    cpuattention.uninstall()
    assert not cpuattention.installed()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_a_models_forward_with_it_picks_the_same_tokens_with_logprobs_within_float_noise(make, on_cpu, mlx_attention):
    model = make()
    ids = mx.array(np.random.default_rng(2).integers(1, 200, 40))[None]

    def logprobs():
        cache = make_prompt_cache(model)
        model(ids[:, :23], cache=cache)  # cached tokens, then a chunk over them (the mask an array for windows)
        out = model(ids[:, 23:], cache=cache).astype(mx.float32)
        return out - mx.logsumexp(out, axis=-1, keepdims=True)

    theirs = logprobs()
    cpuattention.install()
    ours = logprobs()
    assert mx.array_equal(ours.argmax(-1), theirs.argmax(-1)).item()
    assert mx.abs(ours - theirs).max().item() < 1e-4
