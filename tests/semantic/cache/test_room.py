"""One accounting (``semantic.cache.room``): what admission promises, the pool holds, on every layer kind."""

from __future__ import annotations

import numpy as np
import pytest

from semantic.cache import room
from semantic.cache.pool import BlockPool
from semantic.cache.spec import LayerSpec, ModelCacheSpec
from semantic.request import Request
from semantic.sched.scheduler import ConcurrentScheduler
from semantic.store import AgentCacheStore
from tests.tiny_models import byte_tokenizer, tiny_gemma3, tiny_gpt_oss, tiny_lfm2, tiny_llama, tiny_qwen3_next

GEMMA_270M = ModelCacheSpec(tuple(
    LayerSpec("global" if i % 6 == 5 else "sliding", 1, 256, 256, "float32", window=None if i % 6 == 5 else 512)
    for i in range(18)))


def test_a_block_costs_its_own_groups_layers_not_the_whole_models():
    costs = room.block_costs(GEMMA_270M, 256)
    per_layer = 256 * 2 * 256 * 4  # a block of one layer: 256 tokens of K and V, one head of 256, f32
    assert costs == {"sliding-w512-k0": 15 * per_layer, "global": 3 * per_layer}


def test_a_sliding_group_stops_growing_at_its_window_and_the_global_one_grows():
    short, long = room.cache_bytes(GEMMA_270M, 4096, 256), room.cache_bytes(GEMMA_270M, 65536, 256)
    global_block = room.block_costs(GEMMA_270M, 256)["global"]
    assert long - short == global_block * (65536 - 4096) // 256


def test_the_longest_cache_is_the_most_tokens_whose_bytes_fit():
    capacity = 64 << 20
    n = room.longest_cache(GEMMA_270M, capacity, 256)
    assert room.cache_bytes(GEMMA_270M, n, 256) <= capacity < room.cache_bytes(GEMMA_270M, n + 1, 256)
    # was 512 when every block was charged every layer, 2048 before a turn's copy of the 15 sliding layers'
    # windows (15.7 MB, as a turn rebuilds them: they write no buffer of the pool's in place) was charged
    assert n >= 1024 - 256
    assert room.cache_bytes(GEMMA_270M, n, 256) - room.held_copy(GEMMA_270M, n) == sum(
        cost * room.held_blocks(GEMMA_270M, g, n, 256) for g, cost in room.block_costs(GEMMA_270M, 256).items())
    assert room.held_copy(GEMMA_270M, n) == 15 * 512 * 2 * 256 * 4
    assert room.longest_cache(GEMMA_270M, 1 << 20, 256) == 0


def test_a_turn_never_needs_more_than_the_longest_cache_admission_promised():
    for total in (1, 255, 256, 257, 5000):
        for completion in (1, 16, 300):
            prompt = max(1, total - completion)
            # every block of the prompt missed: a window's, or all of them
            misses = {g: min(-(-prompt // 256), room.window_blocks(GEMMA_270M, g, 256) or 1 << 30)
                      for g in GEMMA_270M.groups()}
            assert room.turn_need(GEMMA_270M, misses, prompt, completion, 256) <= room.cache_bytes(
                GEMMA_270M, prompt + completion, 256)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


KINDS = {
    "global": (tiny_llama, 4, {}),
    "global, KV quantized": (tiny_llama, 4, {"kv_bits": 8, "kv_group_size": 32}),
    "sliding and global": (lambda: tiny_gemma3(window=8), 4, {}),
    "a window shorter than a block (snapshots)": (lambda: tiny_gemma3(window=8), 16, {}),
    "sliding with sinks": (tiny_gpt_oss, 4, {}),
    "recurrent and global": (tiny_qwen3_next, 4, {}),
    "convolutional recurrent": (tiny_lfm2, 4, {}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_turn_admission_accepts_is_served_by_an_idle_server(kind, tmp_path):
    make, bt, spec_kw = KINDS[kind]
    model = make()
    spec = ModelCacheSpec.from_model(model, **spec_kw)
    longest = 48
    # the longest cache (with the copy a kind that cannot run in the pool's buffers holds in a turn, which
    # admission charges): a history split by an eviction, part pooled and part read back, is joined, not copied
    store = AgentCacheStore(tmp_path, spec, "tiny", 10**9, pool=BlockPool(
        spec, block_tokens=bt, capacity_bytes=room.cache_bytes(spec, longest, bt)))
    assert room.longest_cache(spec, store.capacity, bt) >= longest
    sched = ConcurrentScheduler(model, byte_tokenizer(), store, stop_tokens=[],
                                ram_budget_bytes=store.capacity // 2)
    try:
        histories = {"a": _ids(1, 20), "b": _ids(2, 30)}
        # two agents take turns, each evicting the other; the last turn of each fills the longest cache
        for turn, (agent, more, last) in enumerate([("a", 0, False), ("a", 9, False), ("b", 0, False),
                                                    ("a", 5, True), ("b", 12, True)]):
            ids = histories[agent] + _ids(10 + turn, more)
            budget = longest - len(ids) if last else 4
            out = sched.submit(Request(agent, ids, budget)).result(120)
            assert len(out.token_ids) == budget, (kind, turn)
            histories[agent] = ids + out.token_ids[:-1]
    finally:
        sched.close(30)
