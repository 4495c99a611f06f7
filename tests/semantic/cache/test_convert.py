"""Extraction into blocks and reconstruction are exact for every cache type."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from semantic import (
    BlockPool,
    CacheMismatchError,
    CacheShapeError,
    LayerSpec,
    ModelCacheSpec,
    PoolExhaustedError,
    UnsupportedCacheError,
)
from harness import noise
from semantic import compat
from semantic.cache.convert import extract, held_outside, reconstruct
from semantic.cache import lending
from semantic.cache.lending import Loan, headroom
from semantic.cache.spec import held_ranges
from tests.tiny_models import tiny_gemma3

pytestmark = pytest.mark.compat


def _run(model, caches, tokens):
    """The last position's logits of row 0; ``tokens`` a list of ids, or of rows of them (a batch)."""
    out = model(mx.array(tokens if isinstance(tokens[0], list) else [tokens]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def _parts(x):
    return x if isinstance(x, tuple) else (x,)


def _spans(blocks):
    return {g: [(b.start, b.end) for b in bl] for g, bl in blocks.groups.items()}


def _gemma_with_keep(keep):
    model = tiny_gemma3(seed=5)
    layers = [
        LayerSpec("sliding", 1, 32, 32, "float32", window=8, keep=keep) if l.kind == "sliding" else l
        for l in ModelCacheSpec.from_model(model).layers
    ]
    return model, ModelCacheSpec(tuple(layers))


CASES = {
    "kv": lambda llama, gemma: (llama, ModelCacheSpec.from_model(llama)),
    "quantized": lambda llama, gemma: (llama, ModelCacheSpec.from_model(llama, kv_bits=4, kv_group_size=32)),
    "mixed": lambda llama, gemma: (gemma, ModelCacheSpec.from_model(gemma)),
    "rotating-keep2": lambda llama, gemma: _gemma_with_keep(2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("total,decode", [(3, 0), (8, 0), (13, 0), (21, 0), (19, 3)])
def test_reconstructed_cache_equals_the_live_one_and_continues_identically(llama_tiny, gemma_tiny, case, total, decode):
    model, spec = CASES[case](llama_tiny, gemma_tiny)
    pool = BlockPool(spec, 64, block_tokens=4)
    tokens = [int(t) for t in np.random.default_rng(total).integers(1, 250, total)]
    live = spec.make_cache()
    _run(model, live, tokens)
    for t in range(decode):  # single-token steps move the ring's write index
        tokens.append(7 + t)
        _run(model, live, [tokens[-1]])

    blocks = extract(pool, live, tokens)
    rebuilt = reconstruct(blocks)
    assert [type(c) for c in rebuilt] == [type(c) for c in live]
    for a, b in zip(live, rebuilt):
        sa, sb = compat.read_layer(a), compat.read_layer(b)
        if sa.kind == compat.ROTATING:
            sa = compat.temporal_rotating(sa)
        assert (sa.offset, sa.keep, sa.max_size, sa.idx, sa.bits) == (sb.offset, sb.keep, sb.max_size, sb.idx, sb.bits)
        for x, y in zip(_parts(sa.keys) + _parts(sa.values), _parts(sb.keys) + _parts(sb.values)):
            assert np.array_equal(np.array(x), np.array(y))
    nxt = [3, 4, 5]
    # the same steps as a batch of two identical rows (other matmul shapes), another correct computation:
    # how far the next logits move here (a chunked prefill is not one: a ring with ``keep`` drops others)
    other = spec.make_cache()
    _run(model, other, [tokens[:total]] * 2)
    for t in tokens[total:]:
        _run(model, other, [[t]] * 2)
    want = _run(model, live, nxt)
    noise.assert_within([_run(model, rebuilt, nxt)], [want], noise.spread([_run(model, other, [nxt] * 2)], [want]),
                        f"{case} rebuilt")


def test_block_layout_follows_block_boundaries_and_the_window(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    pool = BlockPool(spec, 32, block_tokens=4)
    live = spec.make_cache()
    tokens = list(range(1, 14))
    _run(gemma_tiny, live, tokens)
    blocks = extract(pool, live, tokens)
    assert _spans(blocks) == {
        "sliding-w8-k0": [(5, 8), (8, 12), (12, 13)],  # window of 8: positions 5..12
        "global": [(0, 4), (4, 8), (8, 12), (12, 13)],
    }
    assert blocks.total_tokens == 13 and blocks.num_layers() == 4
    assert blocks.blocks_for_layer(1) is blocks.groups["global"]
    assert held_ranges(spec.layers[0], 13) == [(5, 13)]
    keep_layer = LayerSpec("sliding", 1, 32, 32, "float32", window=8, keep=2)
    assert held_ranges(keep_layer, 13) == [(0, 2), (7, 13)]


def test_two_histories_with_a_common_prefix_share_its_full_blocks(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 32, block_tokens=4)
    prefix = list(range(20, 29))  # two full blocks and one token
    a_live, b_live = spec.make_cache(), spec.make_cache()
    _run(llama_tiny, a_live, prefix + [1, 2])
    _run(llama_tiny, b_live, prefix + [3, 4, 5])
    a = extract(pool, a_live, prefix + [1, 2])
    b = extract(pool, b_live, prefix + [3, 4, 5])
    assert [blk.block_id for blk in a.groups["global"][:2]] == [blk.block_id for blk in b.groups["global"][:2]]
    assert a.groups["global"][2] is not b.groups["global"][2]
    assert [pool.refcount(blk) for blk in a.groups["global"]] == [2, 2, 1]
    stats = pool.stats()
    assert (stats.used, stats.shared, stats.hits) == (4, 2, 2)
    a.release()
    assert pool.stats().used == 3 and a.released
    a.release()  # a second release changes nothing
    assert pool.stats().used == 3


def test_extraction_into_a_full_pool_fails_before_taking_any_block(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 2, block_tokens=4)
    live = spec.make_cache()
    _run(llama_tiny, live, list(range(1, 11)))
    before = pool.stats()
    with pytest.raises(PoolExhaustedError, match=r"\(3 of 4 tokens\)"):
        extract(pool, live, list(range(1, 11)))
    assert pool.stats() == before


def test_caches_that_do_not_fit_the_spec_are_refused(llama_tiny, gemma_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = ModelCacheSpec.from_model(gemma_tiny).make_cache()
    _run(gemma_tiny, live, [1, 2, 3])
    with pytest.raises(CacheMismatchError):
        extract(pool, live, [1, 2, 3])
    live = spec.make_cache()
    _run(llama_tiny, live, [1, 2, 3])
    with pytest.raises(CacheMismatchError, match="holds 3 tokens but 2"):
        extract(pool, live, [1, 2])
    with pytest.raises(UnsupportedCacheError, match="ArraysCache"):
        extract(pool, [mlx_cache.ArraysCache(2)] * 3, [])


def test_a_block_with_a_wrong_shape_is_caught_on_reconstruction(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    _run(llama_tiny, live, [1, 2, 3, 4, 5])
    blocks = extract(pool, live, [1, 2, 3, 4, 5])
    blk = blocks.groups["global"][1]
    data = blk.layer_data  # the block's own arrays from here on, one of them of the wrong dtype
    data[2] = (data[2][0].astype(mx.float16), data[2][1])
    blk.layer_data = data
    with pytest.raises(CacheShapeError, match="layer 2 keys"):
        reconstruct(blocks)
    blocks.groups["global"].pop()
    with pytest.raises(CacheMismatchError, match="blocks hold 4 of the 5 tokens"):
        reconstruct(blocks)


def test_released_blocks_cannot_be_reconstructed(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    _run(llama_tiny, live, [1, 2, 3])
    blocks = extract(pool, live, [1, 2, 3])
    blocks.release()
    with pytest.raises(CacheMismatchError, match="released"):
        reconstruct(blocks)


def test_an_empty_history_reconstructs_to_empty_caches(gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    blocks = extract(BlockPool(spec, 4, block_tokens=4), spec.make_cache(), [])
    assert blocks.total_tokens == 0 and blocks.unique_blocks() == []
    assert all(c.empty() for c in reconstruct(blocks))


def _shares(a, b) -> bool:
    return np.shares_memory(np.asarray(a), np.asarray(b))


def test_blocks_from_one_extraction_reconstruct_as_views_of_one_segment(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    ids = list(range(1, 11))
    _run(llama_tiny, live, ids)
    blocks = extract(pool, live, ids)
    segs = {id(b.segment_view.segment) for b in blocks.groups["global"]}
    assert len(segs) == 1  # 3 blocks (4 + 4 + 2 tokens), one copy per layer
    seg = blocks.groups["global"][0].segment_view.segment
    rebuilt = reconstruct(blocks)
    for i, c in enumerate(rebuilt):
        assert _shares(c.keys, seg.layer_data[i][0]) and _shares(c.values, seg.layer_data[i][1])
        assert mx.array_equal(c.keys, compat.read_layer(live[i]).keys).item()


def test_blocks_from_several_extractions_are_concatenated_into_equal_caches(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    ids = list(range(1, 11))
    _run(llama_tiny, live, ids[:8])
    first = extract(pool, live, ids[:8])
    _run(llama_tiny, live, ids[8:])
    second = extract(pool, live, ids)  # blocks 0-1 hit `first`, block 2 is a new segment
    assert [b.block_id for b in second.groups["global"][:2]] == [b.block_id for b in first.groups["global"]]
    rebuilt = reconstruct(second)
    seg = second.groups["global"][2].segment_view.segment
    for i, c in enumerate(rebuilt):
        assert not _shares(c.keys, seg.layer_data[i][0])
        assert mx.array_equal(c.keys, compat.read_layer(live[i]).keys).item()
        assert mx.array_equal(c.values, compat.read_layer(live[i]).values).item()


@pytest.mark.parametrize("tokens, adopted", [(10, False), (1000, True)])
def test_a_finished_buffer_is_pooled_as_it_is_only_when_it_holds_little_spare(llama_tiny, tokens, adopted):
    """mlx-lm grows a cache in steps of 256 slots: 10 tokens in 256 slots are copied exactly (the pool keeps no
    step), 1000 in 1024 are pooled as they are (no copy of the whole cache for 2% spare)."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    live = spec.make_cache()
    for c in live:
        x = mx.random.normal((1, spec.layers[0].n_kv_heads, tokens, spec.layers[0].head_dim))
        c.update_and_fetch(x, x * 2)
    mx.eval([c.keys for c in live])
    assert live[0].keys.shape[2] == 256 * -(-tokens // 256)
    blocks = extract(pool, live, range(tokens))
    seg = blocks.groups["global"][0].segment_view.segment
    for i, c in enumerate(live):
        assert _shares(seg.layer_data[i][0], c.keys) is adopted and _shares(seg.layer_data[i][1], c.values) is adopted
        assert mx.array_equal(seg.layer_data[i][0][..., :tokens, :], c.keys[..., :tokens, :]).item()
    # adopted whole: the spare slots come too, the room of the agent's next turn
    assert seg.n_tokens == tokens and seg.capacity == (live[0].keys.shape[2] if adopted else tokens)


def _address(a) -> int:
    mx.eval(a)
    return np.asarray(a).__array_interface__["data"][0]


@pytest.mark.parametrize("several", [False, True])
def test_a_cache_rebuilt_with_room_takes_the_next_chunk_in_place_and_continues_identically(llama_tiny, several):
    """Room is made in the one copy that joins the pieces (or, from one segment, instead of the copy the first
    write would make); the next chunk is written into it, and the logits are the cache's without room."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    ids = list(range(1, 11))
    if several:
        _run(llama_tiny, live, ids[:8])
        extract(pool, live, ids[:8])
        _run(llama_tiny, live, ids[8:])
    else:
        _run(llama_tiny, live, ids)
    blocks = extract(pool, live, ids)
    roomy, plain = reconstruct(blocks, room=6), reconstruct(blocks)
    seg = blocks.groups["global"][-1].segment_view.segment
    where = [_address(c.keys) for c in roomy]
    for i, c in enumerate(roomy):
        assert c.offset == 10 and c.keys.shape[2] == 16 and not _shares(c.keys, seg.layer_data[i][0])
    new = [11, 12, 13, 14, 15]
    assert mx.array_equal(_run(llama_tiny, roomy, new), _run(llama_tiny, plain, new)).item()
    assert [_address(c.keys) for c in roomy] == where  # written in place: no grown copy
    assert all(c.offset == 15 for c in roomy)


def test_room_leaves_quantized_layers_as_they_were(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny, kv_bits=4, kv_group_size=32)
    pool = BlockPool(spec, 16, block_tokens=4)
    live = spec.make_cache()
    ids = list(range(1, 11))
    _run(llama_tiny, live, ids)
    roomy, plain = reconstruct(extract(pool, live, ids), room=6), reconstruct(extract(pool, live, ids))
    assert [c.keys[0].shape for c in roomy] == [c.keys[0].shape for c in plain]


def _first_turn(model, spec, pool, ids):
    """A finished first turn of ``ids`` pooled as it is (mlx-lm's buffer, spare slots included)."""
    live = spec.make_cache()
    _run(model, live, ids)
    blocks = extract(pool, live, ids)
    seg = blocks.groups["global"][0].segment_view.segment
    assert seg.n_tokens == len(ids) and seg.capacity == live[0].keys.shape[2]
    return blocks, seg


def test_a_turn_lent_the_pools_buffer_writes_there_in_place_and_its_new_blocks_stay_there(llama_tiny):
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]  # 1000 tokens in mlx-lm's 1024 slots
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    loan = Loan()
    lent = reconstruct(first, room=16, loan=loan)
    assert loan.lent == [seg] and seg.lent
    assert all(c.keys is seg.layer_data[i][0] and c.values is seg.layer_data[i][1] for i, c in enumerate(lent))
    other = reconstruct(first, room=16, loan=Loan())  # another turn meanwhile: a copy, never the same buffer
    assert not any(_shares(c.keys, seg.layer_data[i][0]) for i, c in enumerate(other))
    where = [_address(c.keys) for c in lent]
    new = [7, 8, 9, 10, 11]
    assert mx.array_equal(_run(llama_tiny, lent, new), _run(llama_tiny, other, new)).item()
    assert [_address(c.keys) for c in lent] == where  # written in place, into the pool's buffer
    second = extract(pool, lent, ids + new, loan=loan)
    loan.give_back()
    assert not seg.lent and seg.n_tokens == 1005
    assert {id(b.segment_view.segment) for b in second.groups["global"]} == {id(seg)}
    back = reconstruct(second)
    for b, o in zip(back, other):
        assert mx.array_equal(b.keys, o.keys[..., :1005, :]).item() and mx.array_equal(b.values, o.values[..., :1005, :]).item()


def test_the_next_turn_lent_a_segment_is_handed_its_last_turns_caches_started_where_it_resumes(llama_tiny):
    """Making and checking a cache object per layer was most of a small resumed turn's rebuild: the segment
    keeps the ones it handed over, and the next turn lent it gets them again, at its own start, computing what
    a copy does. A segment grown for a turn hands new ones over the new buffers, and the old buffers go."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    blocks, seg = _first_turn(llama_tiny, spec, pool, ids)
    handed = []
    for new in ([7, 8, 9, 10, 11], [12, 13], [14, 15, 16]):
        plain = reconstruct(blocks, room=16)  # a copy: what the turn computes from
        loan = Loan()
        lent = reconstruct(blocks, room=16, loan=loan)
        assert all(c.offset == len(ids) and c.keys is seg.layer_data[i][0] for i, c in enumerate(lent))
        handed.append([id(c) for c in lent])
        assert mx.array_equal(_run(llama_tiny, lent, new), _run(llama_tiny, plain, new)).item()
        ids = ids + new
        blocks = extract(pool, lent, ids, loan=loan)
        loan.give_back()
    assert handed[0] == handed[1] == handed[2]
    old = [weakref.ref(x) for x in [*lent, *(k for k, _ in seg.layer_data.values())]]
    del lent, plain
    lending.grow(seg, 256)  # as for a turn with more than its spare (a decode's widen alike)
    # neither the old caches nor the old buffers are held: the pool keeps the cache once
    assert all(r() is None for r in old)
    loan = Loan()
    grown = reconstruct(blocks, room=256, loan=loan)
    assert all(c.offset == len(ids) and c.keys is seg.layer_data[i][0] for i, c in enumerate(grown))
    loan.give_back()
    # handed back, the kept caches hold no way back to their segment: once nothing else holds it, its buffers go
    # at once, not at the cyclic collector's next pass
    buffers = [weakref.ref(k) for k, _ in seg.layer_data.values()]
    gc.collect()
    gc.disable()
    try:
        blocks.release()
        del blocks, grown, seg, pool
        assert all(r() is None for r in buffers)
    finally:
        gc.enable()


def test_a_segment_without_room_grows_one_layer_at_a_time_and_is_lent(llama_tiny):
    """Too little spare for the turn: the segment grows in place of its old buffers, one layer at a time
    (MLX's peak above the cache is the room and one layer, never a second cache), with headroom for the
    agent's next turns, and the turn is lent it; its blocks read the same bytes."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    before = [np.array(k) for k, _ in seg.layer_data.values()]
    old_bytes = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    loan = Loan()
    caches = reconstruct(first, room=256, loan=loan)  # 24 spare slots: not enough
    grown = 1000 + 256 + headroom(1000)
    assert loan.lent == [seg] and seg.capacity == grown and caches[0].keys.shape[2] == grown
    assert all(c.keys is seg.layer_data[i][0] for i, c in enumerate(caches))
    new_bytes = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    one_layer = max(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    # the growth itself, and one layer's new buffers beside its old ones and its spare slots
    assert mx.get_peak_memory() - start <= new_bytes - old_bytes + 2 * one_layer
    assert all(np.array_equal(np.array(k[..., :1000, :]), b[..., :1000, :]) for (k, _), b in zip(seg.layer_data.values(), before))
    plain = reconstruct(first)
    new = [7, 8, 9, 10, 11]
    assert mx.array_equal(_run(llama_tiny, caches, new), _run(llama_tiny, plain, new)).item()
    second = extract(pool, caches, ids + new, loan=loan)
    loan.give_back()
    assert {id(b.segment_view.segment) for b in second.groups["global"]} == {id(seg)} and seg.n_tokens == 1005


def test_a_turn_resumed_from_inside_a_segment_writes_into_a_copy(llama_tiny):
    """A regenerate resumes before the segment's end: the slots after it hold the other branch, so the turn
    gets a copy with room, and the other branch's blocks keep their bytes."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    tail = np.array(reconstruct(first)[0].keys[..., 990:1000, :])
    loan = Loan()
    caches = reconstruct(first, upto=992, room=256, loan=loan)
    assert loan.lent == [] and not any(_shares(c.keys, seg.layer_data[i][0]) for i, c in enumerate(caches))
    _run(llama_tiny, caches, [7] * 20)
    assert np.array_equal(np.array(reconstruct(first)[0].keys[..., 990:1000, :]), tail)


def test_a_turn_resumed_within_its_segments_last_block_is_lent_it_cut_there_and_the_old_tail_keeps_its_bytes(
        llama_tiny):
    """A completion whose reply the next prompt leaves out resumes one token before its cache's end: the
    blocks past the cut take their own copy (one block slot at most), and the turn writes where they were."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    tail = first.groups["global"][-1]
    before = {i: (np.array(k), np.array(v)) for i, (k, v) in tail.layer_data.items()}
    plain = reconstruct(first, upto=999, room=16)  # a copy: what the turn computes from
    loan = Loan()
    lent = reconstruct(first, upto=999, room=16, loan=loan, pool=pool)
    assert loan.lent == [seg] and seg.n_tokens == 999 and tail.segment_view is None
    assert all(c.keys is seg.layer_data[i][0] for i, c in enumerate(lent))
    where = [_address(c.keys) for c in lent]
    new = [7, 8, 9, 10, 11]
    assert mx.array_equal(_run(llama_tiny, lent, new), _run(llama_tiny, plain, new)).item()
    assert [_address(c.keys) for c in lent] == where  # in place: nothing views the segment past the cut
    for i, (k, v) in tail.layer_data.items():  # the turn wrote over position 999: the old tail kept its own
        assert np.array_equal(np.array(k), before[i][0]) and np.array_equal(np.array(v), before[i][1])
    second = extract(pool, lent, ids[:999] + new, loan=loan)
    loan.give_back()
    assert seg.n_tokens == 1004 and {id(b.segment_view.segment) for b in second.groups["global"]} == {id(seg)}
    for b, p in zip(reconstruct(second), plain):
        assert mx.array_equal(b.keys[..., :999, :], p.keys[..., :999, :]).item()
    assert pool.lookup(tail.token_hash, tail.token_ids) is tail  # still served, from its own bytes


def test_a_cut_drops_an_unreferenced_tail_from_the_pool_and_refuses_past_one_block_slot(llama_tiny):
    import threading

    from semantic.cache.manager import CacheManager

    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1002)]  # a tail block of 2 tokens after 250 full ones
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    tail = first.groups["global"][-1]
    assert (tail.start, tail.n_tokens) == (1000, 2) and tail.token_hash is not None
    held = CacheManager(pool, spec, threading.RLock()).pooled(ids[:1000])
    first.release()  # the tail is cached now: no reference, still keyed
    loan = Loan()
    reconstruct(held, room=8, loan=loan, pool=pool)
    assert loan.lent == [seg] and seg.n_tokens == 1000 and pool.lookup(tail.token_hash, tail.token_ids) is None
    loan.give_back()
    far = Loan()  # 990 is more than one block slot before the end: a copy, the segment untouched
    reconstruct(held, upto=990, room=8, loan=far, pool=pool)
    assert far.lent == [] and seg.n_tokens == 1000


def test_a_regenerated_tail_goes_back_into_the_segment_so_the_next_regenerate_is_lent_again(llama_tiny):
    """The same prompt again: the turn resumes one token before the end, the cut copies the old tail out, the
    turn writes the same tokens, and extraction finds that tail by key: it becomes positions in the segment
    again (its copy dropped), so the history stays one segment and every regenerate writes in place."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1002)]  # a tail block of 2 tokens
    blocks, seg = _first_turn(llama_tiny, spec, pool, ids)
    tail = blocks.groups["global"][-1]
    for turn in range(3):
        plain = reconstruct(blocks, upto=1001, room=8)
        loan = Loan()
        lent = reconstruct(blocks, upto=1001, room=8, loan=loan, pool=pool)
        assert loan.lent == [seg], turn  # lent every time, never a copy
        assert mx.array_equal(_run(llama_tiny, lent, ids[1001:]), _run(llama_tiny, plain, ids[1001:])).item()
        again = extract(pool, lent, ids, loan=loan)
        loan.give_back()
        blocks.release()
        blocks = again
        assert blocks.groups["global"][-1] is tail  # the same keyed block, now back in the segment
        assert tail.segment_view is not None and tail.segment_view.segment is seg and not tail.own_data
        assert seg.n_tokens == 1002
        for b, p in zip(reconstruct(blocks), plain):
            assert mx.array_equal(b.keys[..., :1001, :], p.keys[..., :1001, :]).item()


def test_the_tails_later_cuts_copy_out_stay_cached_so_a_return_to_any_of_those_branches_finds_them(llama_tiny):
    """Turns that resume 6 tokens before the end (a reply the next prompt renders otherwise, more than
    ``LEFT_OUT`` tokens of it): each cut copies the tail out, and every tail stays cached through the cuts
    after it, as any block does, till the pool needs its room: a user who goes back to an earlier branch
    resumes from it (the model matrix's edit, then a return to the branch before it)."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=16)
    ids = [1 + i % 50 for i in range(1000)]  # 62 blocks and 8 tokens in the last slot [992, 1008)
    blocks, seg = _first_turn(llama_tiny, spec, pool, ids)
    tails = []
    for turn in range(3):
        tails.append(blocks.groups["global"][-1])
        loan = Loan()
        lent = reconstruct(blocks, upto=len(ids) - 6, room=16, loan=loan, pool=pool)
        assert loan.lent == [seg] and not loan.left, turn  # 6 tokens left out: not a tail to let go
        ids = ids[:-6] + [7 + turn] * 8
        _run(llama_tiny, lent, ids[-8:])
        again = extract(pool, lent, ids, loan=loan)
        loan.give_back()
        blocks.release()
        blocks = again
        for old in tails:
            assert old.segment_view is None and pool.lookup(old.token_hash, old.token_ids) is old, turn
            assert pool.cached(old), turn


def test_admission_is_told_what_a_turn_would_copy_nothing_when_lent_else_its_cache_and_room(llama_tiny):
    """``held_outside`` answers as ``reconstruct`` then builds: a turn lent the segment holds nothing beyond
    the pool; one that finds it lent to another turn, or resumes too far inside it, holds a copy of exactly
    the bytes it gets (its tokens and its room)."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    copied = lambda caches: sum(c.keys.nbytes + c.values.nbytes for c in caches)
    assert held_outside(first, 1000, 256, pool) == 0
    loan = Loan()
    reconstruct(first, room=256, loan=loan)
    assert loan.lent == [seg]
    predicted = held_outside(first, 1000, 256, pool)  # the segment is another turn's now
    other = Loan()
    assert predicted == copied(reconstruct(first, room=256, loan=other)) > 0 and other.lent == []
    loan.give_back()
    inside = held_outside(first, 992, 256, pool)  # a regenerate further back than the last block slot
    other = Loan()
    assert inside == copied(reconstruct(first, upto=992, room=256, loan=other)) and other.lent == []
    assert inside == (992 + 256) * spec.token_bytes()
    assert held_outside(first, 998, 256, pool) == 0  # within the last block slot: lent, cut there


def test_a_lent_turn_decoding_past_its_room_widens_the_pools_buffer_not_a_copy_beside_it(llama_tiny):
    """A batch of one over a lent segment that runs out of slots mid-decode widens the segment's layers in
    place of their old buffers (one layer beside its old one at a time, never a second cache), keeps writing
    there, and its new blocks are positions in the same segment; every step equals a copy's."""
    from semantic import kinds

    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    loan = Loan()
    lent, other = reconstruct(first, room=16, loan=loan), reconstruct(first, room=16, loan=Loan())
    assert loan.lent == [seg] and seg.capacity == 1024
    new = [7, 8, 9, 10, 11]
    _run(llama_tiny, lent, new), _run(llama_tiny, other, new)
    lent, other = kinds.merge([lent]), kinds.merge([other])
    old_bytes = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    one_layer = max(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    tokens = []
    for step in range(30):  # 1005 tokens in 1024 slots: the 20th decode step needs more
        t = tokens[-1] if tokens else 3
        if step == 19:
            mx.clear_cache()
            mx.reset_peak_memory()
            start = mx.get_active_memory()
        a, b = _run(llama_tiny, lent, [t]), _run(llama_tiny, other, [t])
        if step == 19:
            grown = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
            # the growth, and one layer's old buffers beside its new ones (and a step's activations)
            assert mx.get_peak_memory() - start <= grown - old_bytes + 2 * one_layer + (1 << 18)
        assert mx.array_equal(a, b).item()
        tokens.append(int(mx.argmax(a).item()))
    assert seg.capacity > 1024 and all(c.keys is seg.layer_data[i][0] for i, c in enumerate(lent))
    rows = [c.extract(0) for c in lent]
    second = extract(pool, rows, ids + new + tokens, loan=loan)
    loan.give_back()
    assert {id(b.segment_view.segment) for b in second.groups["global"]} == {id(seg)} and seg.n_tokens == 1035


def test_a_history_split_over_two_segments_is_joined_into_the_first_and_lent(llama_tiny):
    """A turn that got a copy leaves its history in two segments (the first turn's and its new blocks'); the
    next turn's rebuild copies the second's blocks into the first (grown with the turn's room), makes them
    positions there, lends it, and the second segment goes: one copy, lent, exact."""
    spec = ModelCacheSpec.from_model(llama_tiny)
    pool = BlockPool(spec, 600, block_tokens=4)
    ids = [1 + i % 50 for i in range(1000)]
    first, seg = _first_turn(llama_tiny, spec, pool, ids)
    loan = Loan()
    reconstruct(first, room=16, loan=loan)  # another turn has the segment: this one copies
    copied = reconstruct(first, room=16, loan=Loan())
    new = [7, 8, 9, 10, 11, 12, 13]
    _run(llama_tiny, copied, new)
    second = extract(pool, copied, ids + new)
    loan.give_back()
    segs = {id(b.segment_view.segment) for b in second.groups["global"]}
    assert len(segs) == 2 and seg.n_tokens == 1000
    other = next(b.segment_view.segment for b in second.groups["global"] if b.segment_view.segment is not seg)
    assert held_outside(second, 1007, 256, pool) == 0  # admission is told it runs in place
    plain = reconstruct(second)  # a copy, for the continuation to equal
    loan = Loan()
    caches = reconstruct(second, room=256, loan=loan, pool=pool)
    assert loan.lent == [seg] and loan.joined == 1 and seg.n_tokens == 1007 and seg.capacity >= 1007 + 256
    assert all(c.keys is seg.layer_data[i][0] for i, c in enumerate(caches))
    assert {id(b.segment_view.segment) for b in second.groups["global"]} == {id(seg)}
    assert not any(b.segment_view is not None and b.segment_view.segment is other for b in pool._blocks if b)
    more = [20, 21, 22]
    assert mx.array_equal(_run(llama_tiny, caches, more), _run(llama_tiny, plain, more)).item()
    third = extract(pool, caches, ids + new + more, loan=loan)
    loan.give_back()
    assert {id(b.segment_view.segment) for b in third.groups["global"]} == {id(seg)} and seg.n_tokens == 1010
    for b, p in zip(reconstruct(third), plain):
        assert mx.array_equal(b.keys, p.keys[..., :1010, :]).item()
