"""The one door into the cache: a turn's admission, start, rebuild, extraction and release, on a tiny model."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from semantic import BlockPool, ModelCacheSpec
from semantic import compat
from semantic.cache.lending import Loan
from semantic.cache import room
from semantic.cache.manager import CacheManager
from tests.tiny_models import tiny_gemma3, tiny_llama

pytestmark = pytest.mark.compat


def _manager(model, blocks=64):
    spec = ModelCacheSpec.from_model(model)
    return CacheManager(BlockPool(spec, blocks, block_tokens=4), spec, threading.RLock())


def _prefilled(model, spec, ids):
    caches = spec.make_cache()
    model(mx.array([ids]), cache=caches)
    mx.eval([compat.cache_arrays(c) for c in caches])
    return caches


def _extracted(ids):
    """A manager over a tiny llama's pool, the caches of ``ids`` prefilled, and their extracted blocks."""
    model = tiny_llama(seed=3)
    m = _manager(model)
    caches = _prefilled(model, m.spec, ids)
    return m, caches, m.extract(caches, ids, salt_root=None)


def test_an_extracted_cache_is_where_the_next_turn_starts_and_rebuilds_to_the_same_arrays():
    ids = list(range(1, 19))                      # 4 whole blocks of 4 and a tail of 2
    m, caches, blocks = _extracted(ids)
    assert blocks.total_tokens == len(ids)
    start = m.start([*ids, 40, 41], blocks, salt_root=None, share=True)
    assert start.cached == len(ids) and start.blocks is blocks and not start.owned  # its own cache, read
    rebuilt = m.rebuild(blocks)
    for a, b in zip(rebuilt, caches):
        x, y = compat.read_layer(a), compat.read_layer(b)
        assert np.array_equal(np.array(x.keys), np.array(y.keys[..., : len(ids), :]))
    blocks.release()
    assert m.pool.stats().used == 0


def test_another_agent_starts_from_the_pooled_blocks_and_owns_its_references():
    ids = list(range(1, 19))
    m, _, blocks = _extracted(ids)
    start = m.start([*ids[:16], 90, 91, 92], None, salt_root=None, share=True)
    assert (start.cached, start.owned) == (16, True)  # the four whole blocks; the tail is the first agent's
    assert m.start([*ids[:16], 90, 91, 92], None, salt_root=None, share=False).cached == 0  # sharing off
    assert m.start([*ids[:16], 90], None, salt_root=7, share=True).cached == 0  # another tenant's salt
    start.blocks.release()
    blocks.release()
    assert m.pool.stats().used == 0


def test_pooled_is_none_unless_every_block_of_the_prompt_is_in_the_pool():
    ids = list(range(1, 17))
    m, _, blocks = _extracted(ids)
    held = m.pooled(ids)
    assert held is not None and held.total_tokens == 16
    assert m.pooled([*ids[:8], 99, 98, 97, 96]) is None
    held.release()
    blocks.release()


def test_carry_holds_nothing_for_no_positions_and_keep_passed_pools_a_windows_blocks():
    model = tiny_gemma3(seed=5)
    m = _manager(model, blocks=256)
    assert m.carry(list(range(1, 9)), [], salt_root=None) is None
    ids = list(range(1, 33))
    caches = _prefilled(model, m.spec, ids)
    before = m.pool.stats().used
    m.keep_passed(caches, ids, [8, 16], salt_root=None)  # released at once: hittable, not in use
    assert m.pool.stats().used == before
    assert m.start([*ids[:16], 70, 71], None, salt_root=None, share=True).cached == 16


@pytest.mark.parametrize("left_out, dropped", [(1, True), (4, True), (10, False)])
def test_an_old_tail_a_turn_left_a_token_or_two_of_goes_once_the_history_that_held_it_is_released(
        left_out, dropped):
    # an append whose prompt leaves out the reply resumes a token before its cache's end: the cut copies the
    # tail out for the old history (a failed turn leaves it whole), and that copy, a block's memory after every
    # append, goes once the old history does; an edit further back in the block keeps it, to branch back to
    model = tiny_llama(seed=3)
    spec = ModelCacheSpec.from_model(model)
    m = CacheManager(BlockPool(spec, 200, block_tokens=16), spec, threading.RLock())
    ids = [1 + i % 50 for i in range(1004)]  # a tail block of 12 tokens, in mlx-lm's 1024 slots
    old = m.extract(_prefilled(model, spec, ids), ids, salt_root=None)
    tail = old.groups["global"][-1]
    assert tail.segment_view is not None and tail.n_tokens == 12
    loan = Loan()
    cut = len(ids) - left_out
    lent = m.rebuild(old, upto=cut, room=8, loan=loan)
    assert loan.lent and tail.segment_view is None  # lent, cut there, the tail copied out
    new = ids[:cut] + [7, 8, 9]
    model(mx.array([new[cut:]]), cache=lent)
    blocks = m.extract(lent, new, salt_root=None, loan=loan)
    m.give_back(loan)
    assert m.let_go_left() == 0 and m.pool.lookup(tail.token_hash, tail.token_ids) is tail  # the old history holds it
    old.release()
    assert m.let_go_left() == int(dropped)
    assert (m.pool.lookup(tail.token_hash, tail.token_ids) is None) == dropped
    # the old branch again: its last token is the one it feeds; without the old tail, it resumes where the new
    # history's tail leaves it (the cut), a token or two before
    start = m.start(ids, None, salt_root=None, share=True)
    assert start.cached == (cut if dropped else len(ids) - 1)
    if start.owned:
        start.blocks.release()
    blocks.release()


def test_a_prediction_of_what_a_turn_finds_cached_holds_no_reference_and_counts_no_lookup():
    ids = list(range(1, 19))
    m, _, blocks = _extracted(ids)
    before = m.pool.stats()
    prompt = [*ids[:16], 90, 91, 92]
    assert m.cached_now(prompt, None, salt_root=None) == 16  # another agent: the four pooled blocks
    assert m.cached_now([*ids, 40], blocks, salt_root=None) == len(ids)  # the agent's own cache
    after = m.pool.stats()
    assert (after.hits, after.misses, after.used) == (before.hits, before.misses, before.used)
    start = m.start(prompt, None, salt_root=None, share=True)  # the turn itself counts its hits, once
    assert m.pool.stats().hits == before.hits + 4
    start.blocks.release()


def test_a_turns_need_is_the_blocks_the_pool_misses_and_fills_and_its_row_follows_the_room_accounting():
    ids = list(range(1, 19))
    m, _, blocks = _extracted(ids)
    bt = m.pool.block_tokens
    prompt = [*ids[:16], 90, 91, 92]  # 16 tokens pooled, the rest missed
    assert m.turn_need(prompt, 5, None, salt_root=None) == room.turn_need(m.spec, {"global": 1}, len(prompt), 5, bt)
    fresh = [200 + i for i in range(12)]
    assert m.turn_need(fresh, 0, None, salt_root=None) == room.turn_need(m.spec, {"global": 3}, 12, 0, bt)
    assert m.batch_row(12, apart=False) == room.row_bytes(m.spec, 12 + 256)
    blocks.release()


_DOOR = {"semantic.cache.manager": None,  # the door, and the values the flow carries through it
         "semantic.cache.blocks": {"AgentBlocks"}, "semantic.cache.spec": {"ModelCacheSpec"},
         "semantic.cache.pool": {"BlockPool"}}


def test_the_scheduler_and_the_executor_reach_the_cache_only_through_its_manager_and_the_disk_through_the_store():
    root = Path(__file__).resolve().parents[3] / "semantic"
    wrong = []
    for path in sorted([*(root / "sched").glob("*.py"), *(root / "runner").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found = [(node.module, {a.name for a in node.names})]
            else:
                continue
            for module, names in found:
                if module.startswith("semantic.cache"):
                    allowed = _DOOR.get(module, set())
                    if module not in _DOOR or (allowed is not None and (names is None or not names <= allowed)):
                        wrong.append(f"{path.relative_to(root.parent)}: {module} {sorted(names or [])}")
                elif module.startswith("semantic.store."):
                    wrong.append(f"{path.relative_to(root.parent)}: {module}")
    assert not wrong, wrong
