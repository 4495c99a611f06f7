"""The scheduler's RAM budget for resident caches (tiny random-weight models).

Resident bytes are the distinct pool blocks of the caches the scheduler keeps
between turns (``semantic.sched.residency``, ``semantic.sched.planner``); the budget holds after every worker
pass by evicting, least recently used first, caches already saved to disk.
"""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest

from semantic import AgentCacheStore, BlockPool, ConcurrentScheduler, ModelCacheSpec, Request
from tests.cache_helpers import assert_like_fresh, fresh
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

BT = 4  # tokens per block


def _scheduler(model, cache_dir, budget, blocks=512, **kw):
    spec = ModelCacheSpec.from_model(model)
    store = AgentCacheStore(cache_dir, spec, "tiny", 10**9, pool=BlockPool(spec, blocks, BT))
    return ConcurrentScheduler(model, byte_tokenizer(), store, stop_tokens=[], ram_budget_bytes=budget, **kw)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def _bytes(model, tokens: int) -> int:
    """Bytes of a cache of ``tokens`` tokens of a model whose layers are all global."""
    return int(ModelCacheSpec.from_model(model).token_bytes() * tokens)


def _turn(sched, agent, history, max_tokens=2):
    r = sched.submit(Request(agent, history, max_tokens), timeout=None).result(60)
    sched.flush(60)  # saved: evictable from now on
    return r


def test_the_budget_evicts_the_least_recently_used_saved_cache(llama_tiny, cache_dir):
    # 14 + 2 generated, the last never fed = 15 tokens each, nothing shared
    h = {a: _ids(i, 14) for i, a in enumerate("abc")}
    with _scheduler(llama_tiny, cache_dir, budget=_bytes(llama_tiny, 40)) as sched:
        r_a = _turn(sched, "a", h["a"])
        _turn(sched, "b", h["b"])
        a2 = h["a"] + list(r_a.token_ids) + [7, 8]
        _turn(sched, "a", a2)  # a (19 tokens) is now used more recently than b (15)
        assert sched.stats().budget_evictions == 0
        _turn(sched, "c", h["c"])  # 49 tokens > 40: one goes, and it is b, the least recently used
        resident = {x: sched.resident_cache(x) is not None for x in "abc"}
        stats = sched.stats()
        with sched.store.pool_lock:
            used = sched.store.pool.stats().used
        held = {id(b) for x in "abc" if (c := sched.resident_cache(x)) is not None for b in c.unique_blocks()}
        assert used == len(held)  # the one RAM tier holds every block in use: nothing is kept twice
    assert resident == {"a": True, "b": False, "c": True}
    assert stats.budget_evictions == 1 and stats.resident_bytes == _bytes(llama_tiny, 34)
    assert stats.resident_peak_bytes <= stats.ram_budget_bytes == _bytes(llama_tiny, 40)


def test_an_evicted_agent_continues_from_its_file_exactly(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir, budget=_bytes(llama_tiny, 20)) as sched:
        r1 = _turn(sched, "a", _ids(1, 14))
        _turn(sched, "b", _ids(2, 14))  # a is evicted to make b's room
        assert sched.resident_cache("a") is None
        h2 = _ids(1, 14) + list(r1.token_ids) + [3, 4, 5]
        r2 = _turn(sched, "a", h2, max_tokens=3)
        assert sched.store.stats().disk_hits == 1
    assert (r2.reuse, r2.cached_tokens, r2.prompt_tokens) == ("own", 15, 4)  # the reply's last token is never fed
    assert_like_fresh(llama_tiny, r2, fresh(llama_tiny, h2, 3))


def test_unsaved_caches_are_never_evicted_the_worker_waits_for_the_saver(llama_tiny, cache_dir):
    sched = _scheduler(llama_tiny, cache_dir, budget=_bytes(llama_tiny, 24))
    gate, real_save = threading.Event(), sched.store.save
    sched.store.save = lambda *a, **kw: (gate.wait(60), real_save(*a, **kw))[1]
    try:
        first = sched.submit(Request("a", _ids(1, 14), 2)).result(60)
        second = sched.submit(Request("b", _ids(2, 14), 2)).result(60)  # 32 tokens, both unsaved
        blocked = sched.submit(Request("c", _ids(3, 6), 2))  # queued behind the wait
        for _ in range(100):
            if sched.stats().budget_waits:
                break
            threading.Event().wait(0.02)
        waiting = sched.stats()
        assert waiting.budget_waits > 0 and waiting.budget_evictions == 0
        assert sched.resident_cache("a") is not None and sched.resident_cache("b") is not None
        assert not blocked.done()  # no step while the budget does not hold
        gate.set()
        blocked.result(60)
        sched.flush(60)
        stats = sched.stats()
        resident = {x: sched.resident_cache(x) is not None for x in "abc"}
    finally:
        gate.set()
        sched.close(60)
    assert first.cache_saved and second.cache_saved
    assert resident == {"a": False, "b": True, "c": True}  # a went first, once it was on disk
    assert stats.resident_peak_bytes <= _bytes(llama_tiny, 24) and stats.over_budget_steps == 0
    assert stats.budget_wait_s > 0


def test_when_no_save_succeeds_the_budget_drops_unsaved_caches_as_lost_and_the_next_turn_is_exact(
        llama_tiny, cache_dir, monkeypatch):
    budget = _bytes(llama_tiny, 8)
    sched = _scheduler(llama_tiny, cache_dir, budget=budget)

    def disk_full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sched.store._files, "write", disk_full)  # the layout's writer: nothing reaches the disk
    history = _ids(1, 14)
    with sched:
        r = sched.submit(Request("a", history, 2)).result(60)
        sched.flush(60)
        saved = sched.save_outcome(r)
        sched.submit(Request("b", _ids(2, 3), 1)).result(60)  # another pass after the failed save
        sched.flush(60)
        stats = sched.stats()
        dropped = sched.resident_cache("a") is None
        monkeypatch.undo()
        follow = history + list(r.token_ids) + [5, 6]
        r2 = sched.submit(Request("a", follow, 3)).result(60)
    assert saved == "failed" and dropped and stats.lost_caches >= 1
    assert stats.over_budget_steps == 0 and stats.resident_bytes <= budget and stats.save_errors >= 1
    assert r2.reuse in ("pool", "none")  # its own cache is gone; blocks left in the pool may still serve
    assert_like_fresh(llama_tiny, r2, fresh(llama_tiny, follow, 3))


def test_the_budget_holds_after_every_step_across_many_turns_of_many_agents(gemma_tiny, cache_dir):
    rng = np.random.default_rng(0)
    system = _ids(99, 8)  # two whole blocks every agent shares
    agents = [f"agent-{i}" for i in range(8)]
    spec = ModelCacheSpec.from_model(gemma_tiny)
    working_set = len(agents) * int(sum(l.token_bytes() * l.tokens_held(60) for l in spec.layers))
    budget = working_set // 4
    with _scheduler(gemma_tiny, cache_dir, budget=budget, max_batch=4) as sched:
        samples, real_step = [], sched.executor.step_once

        def sampled_step():  # on the worker, before each step: the state the last pass left
            samples.append((sched.resident_bytes(), sched.resident_bytes(recount=True)))
            return real_step()

        sched.executor.step_once = sampled_step
        history = {a: system + _ids(200 + i, 4) for i, a in enumerate(agents)}
        turns = []
        for round_ in range(6):
            futures = {a: sched.submit(Request(a, history[a], int(rng.integers(1, 4))), timeout=None) for a in agents}
            for a, f in futures.items():
                r = f.result(60)
                turns.append((list(history[a]), r))
                history[a] = history[a] + list(r.token_ids) + _ids(round_ * 10 + len(a), int(rng.integers(2, 8)))
        sched.flush(60)
        stats = sched.stats()
    assert stats.failed == 0 and stats.completed == 48
    assert len(samples) >= 12 and all(count == recount for count, recount in samples)
    assert max(count for count, _ in samples) <= budget
    assert stats.resident_peak_bytes <= budget and stats.over_budget_steps == 0
    assert stats.budget_evictions > 0 and stats.steps >= len(samples)
    for h, r in turns[-8:]:  # the last round: most of it from evicted agents' files
        assert_like_fresh(gemma_tiny, r, fresh(gemma_tiny, h, len(r.token_ids)))


def test_a_budget_needs_write_behind_and_a_byte_count(llama_tiny, cache_dir):
    with pytest.raises(ValueError, match="write_behind"):
        _scheduler(llama_tiny, cache_dir, budget=1 << 20, write_behind=False)
    with pytest.raises(ValueError, match="bytes"):
        _scheduler(llama_tiny, cache_dir, budget=-1)


def test_resident_bytes_count_a_block_shared_by_two_agents_once(llama_tiny):
    from semantic.sched.residency import Residency
    from tests.cache_helpers import generate, history, make_executor

    executor = make_executor(llama_tiny, blocks=512)
    prefix = history(16)
    a = generate(executor, "a", prefix + [1], 2).blocks
    b = generate(executor, "b", prefix + [2], 2).blocks
    resident = Residency()
    resident.put("a", a)
    resident.put("b", b)
    shared = {id(x) for x in a.unique_blocks()} & {id(x) for x in b.unique_blocks()}
    assert len(shared) == 4  # 16 tokens in blocks of 4
    assert resident.bytes == a.nbytes + b.nbytes - sum(x.nbytes for x in a.unique_blocks() if id(x) in shared)
    assert resident.recount() == resident.bytes
