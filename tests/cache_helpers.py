"""Helpers shared by the persistence and store tests: real AgentBlocks from
the engine on tiny models, synthetic ones in any geometry, and comparisons;
mlx-lm's own greedy generation, with the noise of its logprobs measured on
this machine, that every test comparing logprobs holds a turn against."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from harness import noise
from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request, compat
from semantic.cache.blocks import AgentBlocks
from semantic.cache.convert import extract, reconstruct
from tests.tiny_models import byte_tokenizer



def reference(model, ids, n: int, kv_bits: int | None = None, spec: ModelCacheSpec | None = None,
              real: bool = False) -> noise.Reference:
    """mlx-lm's generate_step: ``n`` greedy tokens after ``ids`` in fresh caches of ``spec`` (default: the
    model's, ``kv_bits`` KV as the tests' executors make it), with its noise here (harness/noise.py);
    memoized, so a test holding several turns against one history measures it once.

    ``real``: a real model (SmolLM2, Gemma 3 270M), whose decoding variants cost seconds each: its noise is
    measured on one teacher-forced prefill in chunks of about a quarter of the prompt (``noise.few_passes``),
    which on these f32 models moved logprobs as far as any other chunking or batch (docs/tests.md)."""
    spec = spec if spec is not None else ModelCacheSpec.from_model(model, kv_bits=kv_bits, kv_group_size=32)
    variants = noise.few_passes(ids) if real else {}
    return noise.reference(model, list(ids), n, spec.make_cache, key=spec, probe="lazy", **variants)


def check(model, done, kv_bits: int | None = None, spec: ModelCacheSpec | None = None, what: str = "",
          real: bool = False) -> noise.Reference:
    """Assert that a Completion is mlx-lm's greedy generation after its prompt: its tokens (but after a
    near-tie), its logprobs within the measured tolerance. Returns the reference."""
    ref = reference(model, done.request.ids, len(done.token_ids), kv_bits, spec, real)
    ref.check(done.token_ids, done.logprobs, what or done.request.agent_id)
    return ref


def fresh(model, ids, max_tokens: int, kv_bits: int | None = None):
    """A fresh prefill of ``ids`` in a batch executor of its own: a pool of its own, nothing reused."""
    executor = make_executor(model, kv_bits, blocks=64)
    uid = executor.submit(Request("fresh", list(ids), max_tokens), share=False)
    return run(executor)[uid]


def assert_like_fresh(model, got, ref, kv_bits: int | None = None) -> None:
    """A turn and a fresh prefill of its prompt (:func:`fresh`): the same tokens, and both mlx-lm's own
    generation within its measured noise."""
    assert list(got.token_ids) == list(ref.token_ids)
    check(model, got, kv_bits, what="turn")
    check(model, ref, kv_bits, what="fresh prefill")


def check_executor(executor: BatchExecutor, *done, what: str = "", real: bool = False) -> None:
    """:func:`check` for each of an executor's Completions, in the caches of its own spec."""
    for d in done:
        check(executor.model, d, spec=executor.spec, what=what, real=real)


def make_executor(model, kv_bits=None, blocks=256, block_tokens=4, capacity_bytes=None) -> BatchExecutor:
    """A batch executor over a pool of ``blocks`` blocks of the costliest group, or of ``capacity_bytes``."""
    spec = ModelCacheSpec.from_model(model, kv_bits=kv_bits, kv_group_size=32)
    pool = (BlockPool(spec, block_tokens=block_tokens, capacity_bytes=capacity_bytes) if capacity_bytes
            else BlockPool(spec, blocks, block_tokens=block_tokens))
    return BatchExecutor(model, byte_tokenizer(), pool, spec, stop_tokens=[])


def run(executor: BatchExecutor) -> dict:
    return {c.uid: c for c in executor.step()}


def history(n: int, seed: int | None = None) -> list[int]:
    return [int(t) for t in np.random.default_rng(n if seed is None else seed).integers(1, 250, n)]


def generate(executor: BatchExecutor, agent: str, prompt, max_tokens: int, *, share: bool = False):
    """``share``: start from what the pool holds of ``prompt`` (as the engine serves), not a full prefill."""
    uid = executor.submit(Request(agent, prompt, max_tokens), share=share)
    return run(executor)[uid]


def arrays(blocks: AgentBlocks) -> list[np.ndarray]:
    """Every array of the rebuilt mlx-lm caches, in layer order (bfloat16 as raw uint16)."""
    out = []
    for c in reconstruct(blocks):
        st = compat.read_layer(c)
        for x in (st.keys, st.values):
            for a in x if isinstance(x, tuple) else (() if x is None else (x,)):
                out.append(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
    return out


def assert_identical(a: AgentBlocks, b: AgentBlocks) -> None:
    assert a.token_ids == b.token_ids
    assert a.spec == b.spec
    xs, ys = arrays(a), arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


def synthetic(spec: ModelCacheSpec, pool: BlockPool, tokens: list[int], seed: int = 0) -> AgentBlocks:
    """AgentBlocks of random K/V in ``spec``'s geometry (global layers only),
    through a real mlx-lm KVCache and ``extract``; no model needed."""
    key = mx.random.key(seed)
    caches = []
    for layer in spec.layers:
        assert layer.kind == "global" and not layer.kv_bits, "synthetic caches are plain global layers"
        key, kk, kv = mx.random.split(key, 3)
        shape = (1, layer.n_kv_heads, len(tokens))
        c = mlx_cache.KVCache()
        if tokens:
            c.update_and_fetch(
                mx.random.normal((*shape, layer.head_dim), key=kk).astype(layer.mx_dtype),
                mx.random.normal((*shape, layer.v_head_dim), key=kv).astype(layer.mx_dtype),
            )
        caches.append(c)
    return extract(pool, caches, tokens)


def weights_fingerprint(model) -> str:
    """sha256 of a model's parameters (names and bytes), as a stand-in for
    the weight-file fingerprint real models have."""
    import hashlib

    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(np.array(value.view(mx.uint16) if value.dtype == mx.bfloat16 else value).tobytes())
    return h.hexdigest()
