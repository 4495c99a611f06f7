"""Cache files: our verified load and durable save against mlx-lm's, and the readinto floor.

Runs only with ``pytest --benchmark-only``. One SmolLM2-135M cache of 2048
tokens (synthetic tensors in the real geometry, bf16, 47 MB) is written both
ways; pytest-benchmark times our side while the other sides run in the
untimed setup before each round, so they interleave (theirs, ours, theirs,
...). Ratios of p50s go into ``extra_info``. The full sweep (8K tokens, the
Gemma 3 12B geometry, recorded in a results document) is EXP-005's speed
part: ``python -m harness run exp_005_persistence_roundtrip``.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from harness.synthetic import SMOLLM2_135M, synthetic_blocks
from semantic import BlockPool, ModelCacheSpec, cachefile
from semantic.cache import convert

TOKENS = 2048
ROUNDS = 30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    spec = ModelCacheSpec.from_config(SMOLLM2_135M)
    pool, blocks = synthetic_blocks(spec, TOKENS)
    live = convert.reconstruct(blocks)
    d = tmp_path_factory.mktemp("exp005")
    ours, theirs = str(d / "ours.safetensors"), str(d / "mlxlm.safetensors")
    cachefile.save(ours, blocks, model_fingerprint="bench")
    mlx_cache.save_prompt_cache(theirs, live)
    return spec, pool, blocks, live, ours, theirs


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _p50(xs) -> float:
    return float(np.percentile(xs, 50))


@pytest.mark.benchmark(group="persistence")
def test_verified_load_against_mlx_lm_load_and_the_readinto_floor(benchmark, files):
    spec, pool, blocks, _, ours, theirs = files
    buf = np.empty(os.path.getsize(ours), dtype=np.uint8)
    times = {"floor": [], "mlxlm_load": [], "load": []}
    held = []

    def floor():
        with open(ours, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))

    def mlxlm_load():
        caches = mlx_cache.load_prompt_cache(theirs)
        mx.eval([c.state for c in caches])

    def setup():
        held.clear()
        times["floor"].append(_ms(floor))
        times["mlxlm_load"].append(_ms(mlxlm_load))

    def load():
        t = time.perf_counter()
        held.append(cachefile.load(ours, BlockPool(spec, pool.total_blocks)))
        times["load"].append((time.perf_counter() - t) * 1e3)

    for _ in range(3):  # warm-up: allocator and page cache on every side
        setup(), load()
    for xs in times.values():
        xs.clear()
    benchmark.pedantic(load, setup=setup, rounds=ROUNDS, iterations=1)
    p = {k: _p50(v) for k, v in times.items()}
    benchmark.extra_info.update(
        tokens=TOKENS,
        file_mb=os.path.getsize(ours) / 1e6,
        p50_ms=p,
        load_p95_ms=float(np.percentile(times["load"], 95)),
        load_over_mlxlm_p50=p["load"] / p["mlxlm_load"],
        load_over_floor_p50=p["load"] / p["floor"],
        mlxlm_over_floor_p50=p["mlxlm_load"] / p["floor"],
    )
    assert held[-1].total_tokens == TOKENS


@pytest.mark.benchmark(group="persistence")
def test_durable_save_against_mlx_lm_save(benchmark, files):
    _, _, blocks, live, ours, theirs = files
    times = {"mlxlm_save": [], "save": []}

    def setup():
        cachefile.settle()
        times["mlxlm_save"].append(_ms(lambda: mlx_cache.save_prompt_cache(theirs, live)))

    def save():
        t = time.perf_counter()
        cachefile.save(ours, blocks, model_fingerprint="bench")
        times["save"].append((time.perf_counter() - t) * 1e3)

    for _ in range(3):
        setup(), save()
    for xs in times.values():
        xs.clear()
    benchmark.pedantic(save, setup=setup, rounds=ROUNDS, iterations=1)
    p = {k: _p50(v) for k, v in times.items()}
    benchmark.extra_info.update(
        tokens=TOKENS,
        p50_ms=p,
        save_p95_ms=float(np.percentile(times["save"], 95)),
        save_over_mlxlm_p50=p["save"] / p["mlxlm_save"],
    )
    cachefile.settle()
