"""semantic.compat under whichever mlx-lm is installed (make test / make test-compat)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from harness import noise
from harness.baseline import HAS_NEXT_GENERATED
from semantic import compat
from tests.tiny_models import tiny_gemma3

pytestmark = pytest.mark.compat


def _prefill(model, cache, tokens):
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits)
    return logits[0, -1]


def _rows(model, cache, tokens):
    """Row 0's last logits of ``tokens`` fed as a batch of two identical rows."""
    logits = model(mx.array([tokens, tokens]), cache=cache)
    mx.eval(logits)
    return logits[0, -1]


def _greedy(model, cache, first_logits, n):
    out, logits = [], first_logits
    for _ in range(n):
        t = int(mx.argmax(logits))
        out.append(t)
        logits = _prefill(model, cache, [t])
    return out, logits


def _assert_same_state(a: compat.LayerState, b: compat.LayerState):
    assert (a.kind, a.offset, a.keep, a.max_size, a.idx, a.group_size, a.bits) == (
        b.kind, b.offset, b.keep, b.max_size, b.idx, b.group_size, b.bits
    )
    for x, y in ((a.keys, b.keys), (a.values, b.values)):
        xs = x if isinstance(x, tuple) else (x,)
        ys = y if isinstance(y, tuple) else (y,)
        assert len(xs) == len(ys)
        for p, q in zip(xs, ys):
            assert p.shape == q.shape and p.dtype == q.dtype
            assert np.array_equal(np.array(p), np.array(q))


def _caches(model, kind):
    n = len(model.layers)
    if kind == "quantized":
        return [mlx_cache.QuantizedKVCache(group_size=32, bits=8) for _ in range(n)]
    return model.make_cache() if hasattr(model, "make_cache") else [mlx_cache.KVCache() for _ in range(n)]


@pytest.mark.parametrize(
    "which,kind,prompt_len",
    [
        ("llama", "kv", 13),
        ("llama", "quantized", 13),
        ("gemma", "mixed", 5),    # ring buffer not yet full
        ("gemma", "mixed", 21),   # ring buffer wrapped (window 8)
    ],
)
def test_rebuilt_cache_is_bit_identical_and_continues_like_the_original(
    llama_tiny, gemma_tiny, which, kind, prompt_len
):
    model = llama_tiny if which == "llama" else gemma_tiny
    rng = np.random.default_rng(prompt_len)
    tokens = rng.integers(1, 255, size=prompt_len).tolist()
    original = _caches(model, kind)
    logits = _prefill(model, original, tokens)
    # Two decode steps move the rotating write index off the buffer edge.
    _, logits = _greedy(model, original, logits, 2)

    states = [compat.read_layer(c) for c in original]
    rebuilt = [compat.build_layer(s) for s in states]
    assert [type(c) for c in rebuilt] == [type(c) for c in original]
    for s, c in zip(states, rebuilt):
        _assert_same_state(s, compat.read_layer(c))

    a, la = _greedy(model, original, logits, 6)
    b, lb = _greedy(model, rebuilt, logits, 6)
    assert a == b
    assert np.array_equal(np.array(la), np.array(lb))


def test_wrapped_rotating_state_keeps_ring_metadata(gemma_tiny):
    cache = gemma_tiny.make_cache()
    _prefill(gemma_tiny, cache, list(range(1, 22)))
    _greedy(gemma_tiny, cache, _prefill(gemma_tiny, cache, [7]), 3)
    state = compat.read_layer(cache[0])
    assert state.kind == compat.ROTATING
    assert state.offset == 21 + 1 + 3
    assert state.max_size == 8 and state.keys.shape[2] == 8
    assert 0 <= state.idx <= 8


def test_empty_cache_reads_and_rebuilds_empty():
    for fresh in (mlx_cache.KVCache(), mlx_cache.RotatingKVCache(max_size=8, keep=2), mlx_cache.QuantizedKVCache(32, 4)):
        state = compat.read_layer(fresh)
        assert state.keys is None and state.offset == 0
        rebuilt = compat.build_layer(state)
        assert type(rebuilt) is type(fresh) and rebuilt.empty()
    assert compat.build_layer(compat.read_layer(mlx_cache.RotatingKVCache(max_size=8, keep=2))).keep == 2


def test_unsupported_cache_types_are_refused_with_a_named_error():
    with pytest.raises(compat.UnsupportedCacheError, match="ArraysCache"):
        compat.read_layer(mlx_cache.ArraysCache(2))
    with pytest.raises(compat.UnsupportedCacheError):
        compat.LayerState("TupleCache", None, None, 0)
    with pytest.raises(ValueError, match="max_size"):
        compat.LayerState(compat.ROTATING, None, None, 0)
    with pytest.raises(ValueError, match="group_size"):
        compat.LayerState(compat.QUANTIZED, None, None, 0)


def _canonical(state):
    return compat.temporal_rotating(state) if state.kind == compat.ROTATING else state


def _ring(model, keep):
    caches = model.make_cache()
    for i, c in enumerate(caches):
        if isinstance(c, mlx_cache.RotatingKVCache):
            caches[i] = mlx_cache.RotatingKVCache(max_size=8, keep=keep)
    return caches


@pytest.mark.parametrize("prompt_len,decode", [(5, 0), (8, 0), (9, 0), (21, 0), (21, 3), (6, 5)])
@pytest.mark.parametrize("keep", [0, 2])
def test_temporal_rotating_continues_exactly_like_the_ring(prompt_len, decode, keep):
    """Unrolled and cut to the window, a rotating cache gives the same next
    logits as the ring it came from: before the window fills, right at it,
    past it after a long prefill, and mid-ring after decode steps."""
    model = tiny_gemma3(seed=3)
    caches = _ring(model, keep)
    prompt = list(range(50, 50 + prompt_len))
    logits = _prefill(model, caches, prompt)
    decoded, logits = _greedy(model, caches, logits, decode)
    unrolled = [compat.build_layer(_canonical(compat.read_layer(c))) for c in caches]
    for c in unrolled:
        if isinstance(c, mlx_cache.RotatingKVCache):
            assert c.keys.shape[2] <= 8 and c._idx == c.keys.shape[2]
    a, la = _greedy(model, caches, logits, 5)
    b, lb = _greedy(model, unrolled, logits, 5)
    assert a == b
    # the same ring fed the same tokens as a batch of two identical rows (other matmul shapes): another
    # correct computation (a chunked prefill is not one: a ring with ``keep`` drops other positions)
    other = _ring(model, keep)
    for step in [prompt] + [[t] for t in decoded + a]:
        lo = _rows(model, other, step)
    noise.assert_within([lb], [la], noise.spread([lo], [la]), "unrolled")
    # and a multi-token step (the concat path) agrees too
    want = _prefill(model, caches, [1, 2, 3])
    noise.assert_within([_prefill(model, unrolled, [1, 2, 3])], [want],
                        noise.spread([_rows(model, other, [1, 2, 3])], [want]), "unrolled, a multi-token step")


def test_versions_are_reported():
    assert compat.MLX_LM_VERSION.count(".") >= 1
    assert compat.HAS_META_STATE == (not HAS_NEXT_GENERATED)


def test_a_loaded_model_steps_on_another_thread_when_it_keeps_lazy_arrays_outside_its_parameters(tmp_path):
    # bailing_moe_linear computes ``_slope`` lazily in __init__: unevaluated, it names the loading thread's stream
    import threading

    import mlx.core as mx

    from harness.models.zoo import write_tiny

    model, _ = compat.load(write_tiny("bailing_moe_linear", tmp_path / "model"))
    errors = []

    def step():
        try:
            mx.eval(model(mx.array([[1, 2, 3]]), cache=model.make_cache()))
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and errors == []
