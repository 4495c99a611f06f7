"""Sliding windows: window edges shared from the pool, and every turn boundary a restart point.

Tiny Gemma (window 8) in blocks of 4 tokens, so a short history already
moves the window past a block boundary. Blocks reach the pool because the
engine pools, after every prefill chunk, the windows at the block boundaries
it passed (``engine._keep``), and every finished turn is extracted whole; these
tests assume that. References run in an engine with a pool of its own, so they never
feed the pool under test.
"""

from __future__ import annotations

import numpy as np
import pytest

from semantic import Request, cachefile
from semantic.cache import convert
from tests.cache_helpers import assert_identical, check, make_executor, history, run

pytestmark = pytest.mark.compat

STEPS = 8


def _same(got, ref, model):
    """A turn and a fresh prefill of its prompt: the same tokens, both mlx-lm's own generation within its measured noise."""
    assert got.token_ids == ref.token_ids
    check(model, got, what="from the cache")
    check(model, ref, what="fresh prefill")


def _fresh(model, ids, max_tokens=STEPS):
    executor = make_executor(model)
    uid = executor.submit(Request("ref", ids, max_tokens), share=False)
    return run(executor)[uid]


def _turn(executor, agent, ids, own=None, max_tokens=STEPS):
    uid = executor.submit(Request(agent, ids, max_tokens), own)
    return run(executor)[uid]


def test_two_agents_sharing_a_prefix_longer_than_the_window_hold_its_edge_block_once(gemma_tiny):
    executor = make_executor(gemma_tiny)
    shared = history(18, seed=1)
    # 21 tokens (the last generated is never fed): the window holds [13, 21)
    a = _turn(executor, "a", shared + [7, 8], max_tokens=2)
    b = _turn(executor, "b", shared + [9, 10], max_tokens=2)
    edge_a, edge_b = a.blocks.groups["sliding-w8-k0"][0], b.blocks.groups["sliding-w8-k0"][0]
    assert edge_a is edge_b and (edge_a.start, edge_a.end) == (12, 16)  # the pooled block covering 13
    assert executor.pool.refcount(edge_a) == 2
    assert [(x.start, x.end) for x in a.blocks.groups["sliding-w8-k0"]] == [(12, 16), (16, 20), (20, 21)]
    for done, ids in ((a, shared + [7, 8]), (b, shared + [9, 10])):
        _same(done, _fresh(gemma_tiny, ids, 2), gemma_tiny)
        nxt = ids + done.token_ids + [3, 4, 5]
        _same(_turn(executor, "c", nxt, own=done.blocks), _fresh(gemma_tiny, nxt), gemma_tiny)


def test_regenerate_edit_and_return_to_a_branch_reuse_everything_before_the_divergence(gemma_tiny):
    """Five turns past a sliding window (cold, append, regenerate, edit, back to a branch), scaled to a window of 8: each turn reuses up to
    where it differs from something cached, and continues exactly like a fresh prefill."""
    executor = make_executor(gemma_tiny)
    t1 = history(13, seed=2)
    first = _turn(executor, "a", t1, max_tokens=3)                       # 15 tokens, the window moved past 8
    t2 = t1 + first.token_ids + [41, 42, 43, 44]
    second = _turn(executor, "a", t2, own=first.blocks, max_tokens=3)    # append: the whole own cache
    first.blocks.release()  # the scheduler keeps only the newest cache of an agent
    again = _turn(executor, "a", t2, own=second.blocks, max_tokens=3)    # regenerate: all but the last token
    second.blocks.release()
    edited = t2[:16] + [45, 46, 47, 48]
    edit = _turn(executor, "a", edited, own=again.blocks, max_tokens=3)  # the last message edited
    again.blocks.release()
    t3 = t2 + second.token_ids + [46, 47, 48]
    back = _turn(executor, "a", t3, own=edit.blocks, max_tokens=3)       # turn 3 of the first branch
    got = [(c.cached_tokens, len(ids)) for c, ids in ((first, t1), (second, t2), (again, t2), (edit, edited), (back, t3))]
    # a reply's last token is never fed: the next turn prefills it with its own
    assert got == [(0, 13), (15, 20), (19, 20), (16, 20), (22, 26)]
    # the original turn 2's tail was released, but stayed in the pool, reachable by its tokens
    assert back.reuse == "pool"
    for c, ids in ((first, t1), (second, t2), (again, t2), (edit, edited), (back, t3)):
        _same(c, _fresh(gemma_tiny, ids, 3), gemma_tiny)


def test_an_edit_before_the_window_reaches_back_through_pooled_blocks(gemma_tiny):
    executor = make_executor(gemma_tiny)
    first = _turn(executor, "a", history(21, seed=3), max_tokens=6)     # 26 tokens; window [18, 26)
    edited = list(first.blocks.token_ids[:10]) + [99, 30, 31]
    got = _turn(executor, "a", edited, own=first.blocks)
    assert got.cached_tokens == 10                                  # [2, 10) from blocks pooled at turn 1
    _same(got, _fresh(gemma_tiny, edited), gemma_tiny)


def test_a_file_with_a_shared_edge_reloads_shared(gemma_tiny, tmp_path):
    executor = make_executor(gemma_tiny)
    shared = history(18, seed=4)
    done = {a: _turn(executor, a, shared + [i + 1, i + 2], max_tokens=2) for i, a in enumerate("ab")}
    for a, d in done.items():
        info = cachefile.save(tmp_path / f"{a}.safetensors", d.blocks, model_fingerprint="tiny-gemma")
        assert info.format_version == 2 and info.stored_from == {"sliding-w8-k0": 12}
    fresh = make_executor(gemma_tiny)  # a restart: a new pool
    loaded = {a: cachefile.load(tmp_path / f"{a}.safetensors", fresh.pool) for a in done}
    edges = [loaded[a].groups["sliding-w8-k0"][0] for a in "ab"]
    assert edges[0] is edges[1] and (edges[0].start, edges[0].end) == (12, 16)
    assert fresh.pool.refcount(edges[0]) == 2
    for a in "ab":
        assert_identical(loaded[a], done[a].blocks)
        nxt = [*done[a].request.ids, *done[a].token_ids, 5, 6]
        _same(_turn(fresh, a, nxt, own=loaded[a]), _fresh(gemma_tiny, nxt), gemma_tiny)


def test_a_referenced_edge_block_survives_the_pool_recycling_everything_else(gemma_tiny):
    executor = make_executor(gemma_tiny, blocks=24)
    shared = history(18, seed=5)
    keep = _turn(executor, "a", shared + [1, 2], max_tokens=2)
    edge = keep.blocks.groups["sliding-w8-k0"][0]
    before = [np.array(x) for x in convert.reconstruct(keep.blocks)[0].state]
    for i in range(6):  # other agents cycle every free block through the free queue
        other = _turn(executor, f"o{i}", history(18, seed=100 + i), max_tokens=2)
        other.blocks.release()
    assert executor.pool.refcount(edge) == 1 and executor.pool.stats().cached < 24
    after = [np.array(x) for x in convert.reconstruct(keep.blocks)[0].state]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    nxt = shared + [1, 2] + keep.token_ids + [3, 4]
    _same(_turn(executor, "a", nxt, own=keep.blocks), _fresh(gemma_tiny, nxt), gemma_tiny)


def test_pooled_tails_are_indexed_under_their_parent_until_recycled(gemma_tiny):
    executor = make_executor(gemma_tiny, blocks=12)
    # 6 tokens (the one generated is never fed): [0, 4) and the tail [4, 6)
    done = _turn(executor, "a", history(6, seed=6), max_tokens=1)
    tail = done.blocks.groups["global"][-1]
    assert (tail.start, tail.n_tokens) == (4, 2) and tail.token_hash is not None
    parent = done.blocks.groups["global"][0]
    assert executor.pool.children(tail.parent, "global") == [tail] and tail.parent != parent.parent
    done.blocks.release()
    assert executor.pool.children(tail.parent, "global") == [tail]  # released: cached, still reachable
    for i in range(4):  # recycle every block
        _turn(executor, f"o{i}", history(10, seed=200 + i), max_tokens=1).blocks.release()
    assert executor.pool.children(tail.parent, "global") == []


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_pooled_branch_is_reachable_only_under_its_own_root(gemma_tiny, salt):
    from semantic.cache.blockclaim import salt_root_of

    executor = make_executor(gemma_tiny)
    ids = history(13, seed=7)
    uid = executor.submit(Request("a", ids, 3, salt_root=salt_root_of("tenant")))
    run(executor)[uid].blocks.release()
    uid = executor.submit(Request("b", ids + [1, 2], 1, salt_root=salt_root_of(salt)))
    got = run(executor)[uid]
    assert got.cached_tokens == (13 if salt else 0)  # a's 15 tokens start like b's 15 for 13


@pytest.mark.parametrize("block_tokens", [3, 4, 16])
def test_a_file_with_a_shared_edge_loads_into_a_pool_of_any_block_size(gemma_tiny, tmp_path, block_tokens):
    executor = make_executor(gemma_tiny)
    done = _turn(executor, "a", history(18, seed=8) + [1, 2], max_tokens=2)
    path = tmp_path / "a.safetensors"
    assert cachefile.save(path, done.blocks, model_fingerprint="tiny-gemma").stored_from == {"sliding-w8-k0": 12}
    loaded = cachefile.load(path, make_executor(gemma_tiny, block_tokens=block_tokens).pool)
    assert_identical(loaded, done.blocks)
