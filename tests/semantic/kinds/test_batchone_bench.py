"""A resumed turn's end, decoding alone: its row out of the batch and its new blocks into the pool, at
Qwen3-Coder-30B-A3B's KV geometry (48 layers x 4 KV heads x 128, bfloat16) on 8K tokens.

Runs only with ``pytest --benchmark-only`` (``make bench``). Both sides run in the same run, interleaved
(mlx-lm's ``extract``, a copy of the whole row, then ``BatchOneKVCache.extract`` over the row's own buffer),
on the same history, each with new tokens the pool lacks; the ratio's p50 goes into ``extra_info``.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from harness.synthetic import live_caches
from harness.trials.real_geometry.models import GEOMETRIES
from semantic import BlockPool, ModelCacheSpec, kinds
from semantic.cache import convert

TOKENS, NEW, TRIALS = 8000, 250, 5


def _turn_end(spec, pool, history, k: int, leave) -> float:
    """One resumed turn: rebuilt with room, NEW tokens and two decode steps written alone, then timed from
    its row leaving the batch to its blocks pooled (the old buffer freed)."""
    caches = convert.reconstruct(history, room=256)  # the executor's: NEW + 1 rounded up to 256
    x = mx.random.normal((1, 4, NEW, 128), key=mx.random.key(k)).astype(mx.bfloat16)
    for c in caches:
        c.update_and_fetch(x, x)
    batch = [kinds.of(layer).batch([c]) for layer, c in zip(spec.layers, caches)]
    del caches
    for _ in range(2):
        for b in batch:
            b.update_and_fetch(x[..., :1, :], x[..., :1, :])
    mx.eval([b.keys for b in batch])
    ids = [*history.token_ids, *range(10**6 * k, 10**6 * k + NEW + 2)]
    t = time.perf_counter()
    rows = [leave(b) for b in batch]
    del batch
    blocks = convert.extract(pool, rows, ids)
    del rows
    took = (time.perf_counter() - t) * 1e3
    blocks.release()
    return took


@pytest.mark.benchmark(group="batch-one")
def test_a_resumed_turns_end_over_its_own_buffer_against_mlx_lms_copy(benchmark):
    spec = ModelCacheSpec.from_config(GEOMETRIES["qwen3-coder-30b-a3b"]["config"])
    assert (spec.n_layers, spec.layers[0].n_kv_heads, spec.layers[0].head_dim) == (48, 4, 128)
    pool = BlockPool(spec, capacity_bytes=4 * TOKENS * 96 * 1024)
    history = convert.extract(pool, live_caches(spec, TOKENS), range(TOKENS))
    copied, own, rounds = [], [], iter(range(1, 1 << 20))

    def setup():
        copied.append(_turn_end(spec, pool, history, next(rounds), lambda b: C.BatchKVCache.extract(b, 0)))

    def trial():
        own.append(_turn_end(spec, pool, history, next(rounds), lambda b: b.extract(0)))

    benchmark.pedantic(trial, setup=setup, rounds=TRIALS, iterations=1)
    p50 = {k: float(np.percentile(v, 50)) for k, v in {"copied": copied, "own": own}.items()}
    benchmark.extra_info.update(tokens=TOKENS, new_tokens=NEW, mlx_lm_extract_p50_ms=p50["copied"],
                                own_buffer_p50_ms=p50["own"], ratio_p50=p50["own"] / p50["copied"])
