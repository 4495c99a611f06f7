"""What a prefill chunk passes: the windows at the block boundaries inside it, pooled from the cache
the chunk leaves (``SnapshotPositions.passed``, ``convert.keep_passed``). Tiny Gemma, window 8, blocks of 4."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from harness import noise
from semantic import BlockPool, ModelCacheSpec, kinds
from semantic.cache import convert, reuse
from semantic.cache.snapshots import SnapshotPositions
from tests.cache_helpers import history

pytestmark = pytest.mark.compat

BT = 4


def _prefill(model, ids, chunks):
    cache = model.make_cache()
    for a, b in zip([0, *chunks], [*chunks, len(ids)]):
        model(mx.array([ids[a:b]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def test_the_chunks_of_a_prompt_pass_the_boundaries_a_stop_at_every_block_would_have_made(gemma_tiny):
    pts = SnapshotPositions(ModelCacheSpec.from_model(gemma_tiny), BT)
    assert pts.windows and not pts.required and pts.taken(3, 30) == []
    chunks = [(3, 10), (10, 21), (21, 30)]  # fed 3 of 30: the grid 4, 8, ..., 28, never the prompt's end
    assert [pts.passed(3, 30, a, b) for a, b in chunks] == [[4, 8], [12, 16, 20], [24, 28]]
    assert pts.passed(3, 28, 21, 28) == [24]  # a boundary at the prompt's end is the finished cache's


def test_a_model_without_windows_passes_nothing(llama_tiny):
    assert SnapshotPositions(ModelCacheSpec.from_model(llama_tiny), BT).passed(0, 30, 0, 30) == []


def test_a_window_cache_after_a_chunk_holds_the_window_before_the_chunk_too(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    ids = history(30, seed=1)
    cache = _prefill(gemma_tiny, ids, [13])  # the second chunk [13, 30) attends back to 13 - 7
    i = next(i for i, l in enumerate(spec.layers) if l.windowed)
    st = kinds.of(spec.layers[i]).buffered(i, spec.layers[i], cache[i], 30)
    assert st.keys.shape[2] == 7 + 17 and kinds.of(spec.layers[i]).read(i, spec.layers[i], cache[i], 30).keys.shape[2] == 8


@pytest.mark.parametrize("chunks", [[], [13], [5, 17, 26]])
def test_every_boundary_a_chunk_passed_is_a_start_whatever_the_chunks(gemma_tiny, chunks):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    pool = BlockPool(spec, 64, block_tokens=BT)
    ids = history(30, seed=2)
    pts = SnapshotPositions(spec, BT)
    new = 0
    for a, b in zip([0, *chunks], [*chunks, 30]):
        cache = _prefill(gemma_tiny, ids[:b], [*[c for c in chunks if c < b]])
        new += convert.keep_passed(pool, cache, ids[:b], pts.passed(0, 30, a, b))
    # 7 global blocks [0, 28) and the 7 sliding ones the windows at 4 ... 28 held; all released, cached
    assert new == 14 and pool.stats().used == 0 and pool.stats().cached == 14
    for p in range(4, 29, 4):
        start = reuse.choose_start(pool, tuple(ids[:p]) + (1,), None)
        assert start.cached == p, p
        start.blocks.release()


def _rebuilt(pool, ids) -> list[np.ndarray]:
    start = reuse.choose_start(pool, tuple(ids) + (1,), None)
    assert start.cached == len(ids)
    out = [np.array(a) for c in convert.reconstruct(start.blocks) for a in c.state[:2]]
    start.blocks.release()
    return out


def test_a_passed_block_holds_the_keys_and_values_a_stop_there_would_have_pooled(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    ids = history(30, seed=3)
    passed, stopped = BlockPool(spec, 64, block_tokens=BT), BlockPool(spec, 64, block_tokens=BT)
    assert convert.keep_passed(passed, _prefill(gemma_tiny, ids, []), ids, [12]) == 3 + 2  # global [0, 12), window [4, 12)
    convert.extract(stopped, _prefill(gemma_tiny, ids[:12], []), ids[:12]).release()
    # one 30-token chunk against a 12-token one: the same K/V up to float32 summation order, as far as
    # the 12 tokens prefilled in two chunks move from one (another correct computation) on this machine
    split = BlockPool(spec, 64, block_tokens=BT)
    convert.extract(split, _prefill(gemma_tiny, ids[:12], [5]), ids[:12]).release()
    want = _rebuilt(stopped, ids[:12])
    noise.assert_within(_rebuilt(passed, ids[:12]), want, noise.spread(_rebuilt(split, ids[:12]), want), "passed")
