"""ConcurrentScheduler on tiny random-weight models: ordering, sharing, edits, backpressure, restarts.

Every continuation is compared with a fresh prefill of the same history
(``fresh``), both held against mlx-lm's own generation within the noise
measured beside it (``tests.cache_helpers``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from semantic import (
    AgentCacheStore,
    BlockPool,
    ConcurrentScheduler,
    InvalidAgentIdError,
    InvalidRequestError,
    ModelCacheSpec,
    PoolExhaustedError,
    QueueFullError,
    Request,
    SchedulerClosedError,
    TurnTooLargeError,
    encode,
    render_chat,
)
from semantic.cache import room
from tests.cache_helpers import assert_like_fresh, fresh
from tests.tiny_models import byte_tokenizer, tiny_lfm2
from tests.waits import until

pytestmark = pytest.mark.compat


def _scheduler(model, cache_dir, blocks=256, block_tokens=4, **kw):
    spec = ModelCacheSpec.from_model(model)
    store = AgentCacheStore(cache_dir, spec, "tiny", 10**9, pool=BlockPool(spec, blocks, block_tokens))
    return ConcurrentScheduler(model, byte_tokenizer(), store, stop_tokens=[], **kw)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def test_turns_of_one_agent_run_in_order_one_at_a_time_and_each_reuses_the_last(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        h1 = _ids(1, 10)
        f1 = sched.submit(Request("a", h1, 3))
        r1 = f1.result(30)
        h2 = h1 + list(r1.token_ids) + _ids(2, 5)
        h3 = h2 + [0, 0, 0]  # queued behind turn 2: its own cache is turn 2's prompt only after turn 2 ran
        f2, f3 = sched.submit(Request("a", h2, 3)), sched.submit(Request("a", h3, 3))
        r2, r3 = f2.result(30), f3.result(30)
    assert (r1.reuse, r1.cached_tokens) == ("none", 0)
    # the reply's last token is never fed: it is prefilled with the new ones
    assert (r2.reuse, r2.cached_tokens, r2.prompt_tokens) == ("own", 12, 6)
    # turn 3 saw turn 2's cache (h2 + reply but its last token), cut where h3 differs from it
    assert r3.reuse == "own-cut" and r3.cached_tokens == len(h2)
    assert r3.latency_s - r3.queued_s >= 0 and r3.queued_s > 0
    for r, h in ((r1, h1), (r2, h2), (r3, h3)):
        assert_like_fresh(llama_tiny, r, fresh(llama_tiny, h, 3))


def test_agents_share_a_common_prefix_held_once_in_the_pool(llama_tiny, cache_dir):
    system = _ids(7, 16)  # four whole blocks
    with _scheduler(llama_tiny, cache_dir) as sched:
        first = sched.submit(Request("a", system + [1, 2, 3], 2)).result(30)
        later = [sched.submit(Request(f"b{i}", system + _ids(10 + i, 6), 2)) for i in range(3)]
        results = [f.result(30) for f in later]
        sched.flush(30)
        pool = sched.store.pool
        shared = [b for b in sched.resident_cache("a").groups["global"][:4]]
        assert all(pool.refcount(b) >= 4 for b in shared)  # a, b0, b1, b2 (+ the store's RAM tier)
    assert first.cached_tokens == 0
    assert [(r.reuse, r.cached_tokens) for r in results] == [("pool", 16)] * 3
    for i, r in enumerate(results):
        assert_like_fresh(llama_tiny, r, fresh(llama_tiny, system + _ids(10 + i, 6), 2))


def test_many_agents_submitting_from_threads_all_get_their_own_continuations(gemma_tiny, cache_dir):
    histories = {f"agent-{i}": _ids(100 + i, 5 + 3 * i) for i in range(6)}
    results: dict[str, list] = {a: [] for a in histories}

    def converse(agent):
        h = list(histories[agent])
        for turn in range(3):
            r = sched.submit(Request(agent, h, 4), timeout=None).result(60)
            results[agent].append((list(h), r))
            h = h + list(r.token_ids) + _ids(turn, 3)

    with _scheduler(gemma_tiny, cache_dir, max_batch=4) as sched:
        threads = [threading.Thread(target=converse, args=(a,)) for a in histories]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = sched.stats()
    assert stats.completed == 18 and stats.failed == 0
    for agent, turns in results.items():
        for h, r in turns:
            assert_like_fresh(gemma_tiny, r, fresh(gemma_tiny, h, 4))
        assert all(r.cached_tokens > 0 for _, r in turns[1:])


def test_asyncio_callers_await_their_results(llama_tiny, cache_dir):
    async def main(sched):
        return await asyncio.gather(*(sched.submit_async(Request(f"x{i}", _ids(i, 9), 3)) for i in range(4)))

    with _scheduler(llama_tiny, cache_dir) as sched:
        results = asyncio.run(main(sched))
    for i, r in enumerate(results):
        assert_like_fresh(llama_tiny, r, fresh(llama_tiny, _ids(i, 9), 3))


def test_a_full_queue_rejects_at_once_or_waits_with_a_timeout(llama_tiny, cache_dir):
    sched = _scheduler(llama_tiny, cache_dir, max_queued=2, max_batch=1)
    gate = threading.Event()
    real_step = sched.executor.step_once
    sched.executor.step_once = lambda: (gate.wait(30), real_step())[1]  # holds the batch so the queue fills
    futures = [sched.submit(Request("a", _ids(1, 6), 2))]
    assert until(lambda: sched.stats().in_flight == 1)  # admitted: in flight, not queued
    futures += [sched.submit(Request("a", _ids(2, 6), 2)), sched.submit(Request("b", _ids(3, 6), 2))]
    with pytest.raises(QueueFullError, match="max_queued=2"):
        sched.submit(Request("c", _ids(4, 6), 2))
    threading.Timer(0.3, gate.set).start()
    waited = sched.submit(Request("c", _ids(4, 6), 2), timeout=30)  # room opens once the gate lifts
    assert all(f.result(30).finish_reason == "length" for f in futures + [waited])
    assert sched.stats().rejected == 1
    sched.close()
    with pytest.raises(SchedulerClosedError):
        sched.submit(Request("a", _ids(1, 6)))


def test_a_turn_the_pool_can_never_hold_fails_with_a_clear_error_and_others_go_on(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir, blocks=8) as sched:
        too_big = sched.submit(Request("big", _ids(1, 60), 2))
        fine = sched.submit(Request("small", _ids(2, 6), 2))
        with pytest.raises(TurnTooLargeError, match="larger pool"):  # a 400: no retry fits it
            too_big.result(30)
        assert fine.result(30).finish_reason == "length"
        assert sched.stats().failed == 1


def test_admission_charges_a_turn_the_copy_of_its_cache_it_cannot_run_in_place(llama_tiny, cache_dir):
    """An append is lent the agent's segment and reserves only its blocks; a regenerate from far inside
    the segment (where other blocks read what it would write) gets a copy, and reserves that copy too."""
    with _scheduler(llama_tiny, cache_dir) as sched:
        h = _ids(3, 100)
        r = sched.submit(Request("a", h, 2)).result(30)
        with sched._cv:
            own = sched.planner.own_cache("a")
        spec = sched.store.spec
        blocks = lambda req: room.turn_need(spec, sched.store.claim(req.ids, None).misses, len(req.ids),
                                            req.max_tokens, 4)
        append, back = Request("a", h + list(r.token_ids) + _ids(4, 3), 2), Request("a", h[:50], 2)
        assert sched.origin.need(append, own) == blocks(append)
        assert sched.origin.need(back, own) == blocks(back) + (49 + 256) * spec.token_bytes()
        assert sched.submit(back).result(30).cached_tokens == 49
        assert sched.executor.cache_manager.in_place()["copied_turns"] == 1


def test_a_small_pool_evicts_saved_agents_and_reloads_them_from_disk(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir, blocks=12) as sched:  # 3 agents fill it
        hist = {a: _ids(i, 14) for i, a in enumerate("abcd")}
        first = {a: sched.submit(Request(a, h, 2)).result(30) for a, h in hist.items()}
        sched.flush(30)
        nxt = {a: hist[a] + list(first[a].token_ids) + [5, 6] for a in hist}
        second = {a: sched.submit(Request(a, h, 2)).result(30) for a, h in nxt.items()}
        stats = sched.stats()
    assert stats.failed == 0 and sched.store.stats().disk_hits > 0 and sched.stats().resident_agents < 4
    for a, r in second.items():
        assert r.cached_tokens == 15  # 14 + 2 generated, the last never fed
        assert_like_fresh(llama_tiny, r, fresh(llama_tiny, nxt[a], 2))


def test_conversations_continue_from_disk_after_a_restart(gemma_tiny, cache_dir):
    h = _ids(5, 20)
    with _scheduler(gemma_tiny, cache_dir) as sched:
        r1 = sched.submit(Request("a", h, 4)).result(30)
    assert sched.stats().saves == 1
    h2 = h + list(r1.token_ids) + [9, 8, 7]
    with _scheduler(gemma_tiny, cache_dir) as restarted:  # a new pool, store and engine: only the file remains
        r2 = restarted.submit(Request("a", h2, 6)).result(30)
        assert restarted.store.stats().disk_hits == 1
    assert (r2.reuse, r2.cached_tokens) == ("own", 23)  # 20 + 4 generated, the last never fed
    assert_like_fresh(gemma_tiny, r2, fresh(gemma_tiny, h2, 6))


def test_bad_requests_raise_at_submit_and_queue_nothing(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        for agent, prompt, kw, err in [
            ("../etc", [1, 2], {}, None),  # an odd id is fine: it never becomes a path
            ("", [1, 2], {}, InvalidAgentIdError),
            ("a", [], {}, InvalidRequestError),
            ("a", [1, 2], {"max_tokens": 0}, InvalidRequestError),
            ("a", [{"role": "user"}], {}, InvalidRequestError),
            ("a", object(), {}, InvalidRequestError),
        ]:
            if err is None:
                sched.submit(Request(agent, encode(sched.tokenizer, prompt), **kw)).result(30)
            else:
                with pytest.raises(err):
                    sched.submit(Request(agent, encode(sched.tokenizer, prompt), **kw))
        bad_ids = sched.submit(Request("a", [1, 2, 10_000], 2))  # out of the vocabulary: fails in the engine
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            bad_ids.result(30)
        assert sched.stats().submitted == 2


def test_render_chat_needs_messages_and_a_template():
    with pytest.raises(InvalidRequestError, match="chat template"):
        render_chat(byte_tokenizer(), [{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError):
        render_chat(byte_tokenizer(), [])


def test_a_failing_step_fails_only_the_turns_in_flight_and_the_scheduler_keeps_serving(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        broken = sched.executor

        def boom():
            raise RuntimeError("device lost")

        broken.step_once = boom
        lost = sched.submit(Request("a", _ids(1, 6), 2))
        with pytest.raises(RuntimeError, match="device lost"):
            lost.result(30)
        assert sched.executor is not broken  # a fresh engine over the same pool
        again = sched.submit(Request("a", _ids(1, 6), 2)).result(30)
        assert sched.stats().failed == 1
    assert_like_fresh(llama_tiny, again, fresh(llama_tiny, _ids(1, 6), 2))


def _held_worker(sched):
    """An Event the worker waits on in the next ``_finish`` (after the last token, before the Completion)."""
    gate, reached = threading.Event(), threading.Event()
    finish = sched._finish

    def held(c):
        reached.set()
        assert gate.wait(30), "the test never let the worker go on"
        finish(c)

    sched._finish = held
    return gate, reached


def test_a_turns_tokens_are_answered_before_its_cache_is_extracted(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        gate, reached = _held_worker(sched)
        h1 = _ids(3, 10)
        future = sched.submit(Request("a", h1, 3))
        early = future.tokens.result(30)  # while the worker is still to extract the cache
        assert not future.done() and early.blocks is None
        gate.set()
        full = future.result(30)
    assert (early.token_ids, early.logprobs, early.finish_reason) == (full.token_ids, full.logprobs, full.finish_reason)
    assert (early.cached_tokens, early.history_tokens, early.reuse) == (full.cached_tokens, full.history_tokens, full.reuse)
    assert early.finished_at <= full.finished_at and reached.is_set()
    assert_like_fresh(llama_tiny, full, fresh(llama_tiny, h1, 3))


def test_a_follow_up_sent_when_the_tokens_are_final_waits_for_and_reuses_the_whole_cache(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        gate, reached = _held_worker(sched)
        h1 = _ids(4, 10)
        f1 = sched.submit(Request("a", h1, 3))
        r1 = f1.tokens.result(30)
        h2 = h1 + list(r1.token_ids) + _ids(5, 5)
        admitted = []
        f2 = sched.submit(Request("a", h2, 3, on_admit=admitted.append))
        assert reached.wait(30) and not f1.done()
        time.sleep(0.05)
        assert admitted == [] and sched.holds("a")  # one turn in flight per agent: the second waits
        gate.set()
        r2 = f2.result(30)
    # the whole cache: h1 and the reply but its last token, never fed (prefilled with the new ones)
    assert (r2.reuse, r2.cached_tokens, r2.prompt_tokens) == ("own", len(h1) + 2, 6)
    assert admitted == [len(h1) + 2]
    assert_like_fresh(llama_tiny, r2, fresh(llama_tiny, h2, 3))


def test_a_turn_whose_tokens_are_final_is_not_cancelled_and_keeps_its_whole_cache(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        gate, _ = _held_worker(sched)
        h1 = _ids(6, 10)
        future = sched.submit(Request("a", h1, 3))
        future.tokens.result(30)
        assert sched.cancel(future) is False  # a client that leaves after its last token costs the cache nothing
        gate.set()
        done = future.result(30)
        assert done.finish_reason == "length" and sched.stats().cancelled == 0
        assert sched.resident_cache("a").total_tokens == len(h1) + 2  # the reply's last token is never fed


def test_a_queued_cancel_and_a_failed_turn_answer_both_futures(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir, blocks=4) as sched:
        too_big = sched.submit(Request("big", _ids(8, 64), 3))
        with pytest.raises(PoolExhaustedError):
            too_big.tokens.result(30)
        with pytest.raises(PoolExhaustedError):
            too_big.result(30)


def test_a_store_that_raises_while_loading_costs_the_turn_its_cache_not_the_worker(llama_tiny, cache_dir):
    h = _ids(7, 20)
    with _scheduler(llama_tiny, cache_dir) as sched:
        r1 = sched.submit(Request("a", h, 4)).result(30)
    h2 = h + list(r1.token_ids) + [9, 8]
    with _scheduler(llama_tiny, cache_dir) as restarted:
        def broken(agent_id, for_ids=None):  # a bug in a load path, not a damaged file (those are quarantined)
            raise TypeError("a load path's bug")

        restarted.store.load = broken
        r2 = restarted.submit(Request("a", h2, 5)).result(30)  # answered, not hung
        assert r2.cached_tokens == 0
        assert_like_fresh(llama_tiny, r2, fresh(llama_tiny, h2, 5))
        assert restarted.submit(Request("b", _ids(8, 9), 3)).result(30).token_ids  # the worker still serves


def _gated_saves(sched):
    """A gate the saver waits at before writing each save (the bytes stay unwritten while it is shut);
    the real write follows. Opened at first."""
    gate, files = threading.Event(), sched.store._files
    write = files.write
    gate.set()

    def gated(*args, **kw):
        assert gate.wait(30), "the test never opened the gate"
        return write(*args, **kw)

    files.write = gated
    return gate


def _address(sched, agent: str) -> int:
    """Where the agent's first layer's keys live: its pooled segment's buffer."""
    blocks = sched.planner.residency.get(agent)
    seg = next(iter(blocks.groups.values()))[0].segment_view.segment
    return np.asarray(memoryview(seg.layer_data[0][0])).ctypes.data


def test_a_turn_waits_for_its_agents_save_to_write_its_bytes_then_writes_into_the_pooled_buffer_in_place(
        llama_tiny, cache_dir):
    # a save holds views of the pool's buffer until its bytes are written: a turn writing there before
    # would make MLX copy the whole buffer (the cache held twice)
    with _scheduler(llama_tiny, cache_dir, blocks=1024, block_tokens=16) as sched:
        gate = _gated_saves(sched)
        h1 = _ids(7, 40)
        r1 = sched.submit(Request("a", h1, 3)).result(30)
        assert until(lambda: not sched.planner.saves.busy, 30)  # turn 1's save is out: turn 2 starts at once
        h2 = h1 + list(r1.token_ids) + _ids(8, 20)
        gate.clear()
        r2 = sched.submit(Request("a", h2, 3)).result(30)  # grows the agent's segment, then writes in it
        address = _address(sched, "a")
        h3 = h2 + list(r2.token_ids) + _ids(9, 20)
        admitted = []
        f3 = sched.submit(Request("a", h3, 3, on_admit=admitted.append))
        assert until(lambda: sched.planner.saves.wanted == {"a"}, 30)  # deferred for turn 2's save
        assert admitted == [] and not f3.done()
        gate.set()
        r3 = f3.result(30)
        stats = sched.executor.cache_manager.in_place()
        assert until(lambda: not sched.planner.saves.busy, 30)
        assert _address(sched, "a") == address  # written in place: no copy of the buffer
    assert admitted == [len(h2) + 2] and r3.reuse == "own"
    assert stats["lent_turns"] == 2 and stats["copied_turns"] == 0
    assert_like_fresh(llama_tiny, r3, fresh(llama_tiny, h3, 3))


def test_an_idle_worker_keeps_a_turns_working_buffers_for_a_moment_then_gives_back_everything(
        llama_tiny, cache_dir, monkeypatch):
    # the next turn of a burst finds the last one's buffers; a quiet server holds only its caches (EXP-023)
    from semantic import heap

    keeps, give_back = [], heap.give_back
    monkeypatch.setattr(heap, "give_back", lambda keep=heap.KEEP_BYTES: (keeps.append(keep), give_back(keep))[1])
    monkeypatch.setattr(heap, "QUIET_S", 60.0)
    with _scheduler(llama_tiny, cache_dir, blocks=2048, block_tokens=16) as sched:
        sched.submit(Request("a", _ids(10, 20), 2)).result(60)
        assert until(lambda: keeps and not sched.planner.saves.busy, 30)
        assert set(keeps) == {heap.KEEP_BYTES}  # not quiet long enough yet
        monkeypatch.setattr(heap, "QUIET_S", 0.05)
        keeps.clear()
        sched.submit(Request("b", _ids(11, 40), 2)).result(60)
        assert until(lambda: 0 in keeps, 30)
        assert keeps[0] == heap.KEEP_BYTES and keeps[-1] == 0


def test_an_agent_returning_to_its_branch_after_an_edit_and_a_subagent_finds_its_whole_cache(cache_dir):
    """EXP-022's round on a hybrid, every agent evicted after its turns (a RAM budget under one cache): first,
    append, regenerate, an edit that diverges inside the history, a sub-agent sharing the system prompt, then
    the append's branch continued. A turn lent the segment cut where it diverges must never cut into a full
    block the pool still keeps past it (another branch's): the return finds its whole branch."""
    model = tiny_lfm2()
    spec = ModelCacheSpec.from_model(model)
    store = AgentCacheStore(cache_dir, spec, "tiny", 10**9, pool=BlockPool(spec, capacity_bytes=256 << 20))
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(1, 250, n)]
    hist = {}
    with ConcurrentScheduler(model, byte_tokenizer(), store, stop_tokens=[], ram_budget_bytes=1) as sched:
        def turn(agent, prompt, keep=True):
            out = sched.submit(Request(agent, prompt, 8)).result(120)
            if keep:
                hist[agent] = prompt + list(out.token_ids)
            return out

        system = ids(600)
        turn("a", system + ids(244))
        append = hist["a"] + ids(270)
        assert turn("a", append).cached_tokens == 851
        assert turn("a", append, keep=False).cached_tokens == len(append) - 1        # regenerate
        assert turn("a", hist["a"][:-8 - 270] + ids(262), keep=False).cached_tokens == 851  # edit
        assert turn("sub", system + ids(250)).cached_tokens == 512                   # the system prompt's blocks
        back = hist["a"] + ids(270)
        out = turn("a", back)
    assert out.cached_tokens >= len(append) + 7, (out.cached_tokens, len(append))
    assert_like_fresh(model, out, fresh(model, back, 8))
