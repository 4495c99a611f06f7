"""BatchExecutor on tiny random-weight models.

The invariant: generate from S, extract, reconstruct, continue with T; the
result equals a fresh prefill of S + generated + T. Both are held against
mlx-lm's own generate_step of that history, within the spread its chunked and
batched variants show on this machine (``tests.cache_helpers.reference``):
a cached continuation and a long prefill differ only in summation order,
while a wrong or missing token moves logprobs by far more than 1e-2 here.
"""

from __future__ import annotations

import numpy as np
import pytest

from semantic import (
    AgentBusyError,
    BlockPool,
    BatchExecutor,
    CacheMismatchError,
    InvalidRequestError,
    ModelCacheSpec,
    Request,
    UnknownSequenceError,
    encode,
)
from tests.cache_helpers import check_executor
from tests.tiny_models import byte_tokenizer, tiny_gemma3

pytestmark = pytest.mark.compat

STEPS = 32


def _executor(model, kv_bits=None, blocks=256, block_tokens=4, stop=()):
    spec = ModelCacheSpec.from_model(model, kv_bits=kv_bits, kv_group_size=32)
    pool = BlockPool(spec, blocks, block_tokens=block_tokens)
    return BatchExecutor(model, byte_tokenizer(), pool, spec, stop_tokens=list(stop))


def _run(executor):
    return {c.uid: c for c in executor.step()}


def _assert_same(executor, cached, fresh):
    assert cached.token_ids == fresh.token_ids
    check_executor(executor, cached, fresh)


@pytest.mark.parametrize(
    "which,kv_bits,history",
    [
        ("llama", None, 21),
        ("llama", 8, 21),     # QuantizedKVCache: the solo lane
        ("gemma", None, 5),   # window of 8 not yet full
        ("gemma", None, 37),  # ring buffer wrapped many times
    ],
)
def test_continuing_from_reconstructed_blocks_equals_a_fresh_prefill(llama_tiny, gemma_tiny, which, kv_bits, history):
    model = llama_tiny if which == "llama" else gemma_tiny
    executor = _executor(model, kv_bits)
    S = [int(t) for t in np.random.default_rng(history).integers(1, 250, history)]
    T = [11, 12, 13, 14, 15]
    uid = executor.submit(Request("a", S, 6), share=False)
    first = _run(executor)[uid]
    assert first.blocks.total_tokens == len(S) + 5  # the last generated token is never fed

    cached_uid = executor.submit(Request("a", S + first.token_ids + T, STEPS), first.blocks, share=False)
    fresh_uid = executor.submit(Request("b", S + first.token_ids + T, STEPS), share=False)
    done = _run(executor)
    cached, fresh = done[cached_uid], done[fresh_uid]
    assert (cached.prompt_tokens, cached.cached_tokens) == (1 + len(T), len(S) + 5)
    assert fresh.prompt_tokens == len(S) + 6 + len(T)
    assert len(cached.token_ids) == STEPS
    _assert_same(executor, cached, fresh)


def test_a_batch_of_three_finishes_independently_and_each_continues(llama_tiny):
    executor = _executor(llama_tiny)
    prompts = {"x": list(range(30, 37)), "y": list(range(60, 79)), "z": list(range(90, 101))}
    limits = {"x": 5, "y": 2, "z": 8}
    uids = {a: executor.submit(Request(a, p, limits[a]), share=False) for a, p in prompts.items()}
    finished = list(executor.step())
    assert [c.agent_id for c in finished] == ["y", "x", "z"]  # yielded as each finishes
    assert {c.agent_id: len(c.token_ids) for c in finished} == limits
    by_agent = {c.agent_id: c for c in finished}
    assert all(by_agent[a].uid == uids[a] for a in prompts)

    more = [5, 6, 7]
    cont = {a: executor.submit(Request(a, prompts[a] + by_agent[a].token_ids + more, 12), by_agent[a].blocks, share=False)
            for a in prompts}
    ref = {a: executor.submit(Request(f"{a}-fresh", prompts[a] + by_agent[a].token_ids + more, 12), share=False) for a in prompts}
    done = _run(executor)
    for a in prompts:
        _assert_same(executor, done[cont[a]], done[ref[a]])


def test_two_agents_with_a_common_prefix_hold_it_once_and_both_continue(gemma_tiny):
    executor = _executor(gemma_tiny, block_tokens=4)
    prefix = list(range(40, 52))  # 3 full blocks of 4
    ua = executor.submit(Request("a", prefix + [1, 2], 2), share=False)
    ub = executor.submit(Request("b", prefix + [3], 2), share=False)
    done = _run(executor)
    a, b = done[ua].blocks, done[ub].blocks
    shared = [x for x in a.groups["global"][:3]]
    assert shared == b.groups["global"][:3]
    assert [executor.pool.refcount(x) for x in shared] == [2, 2, 2]
    assert executor.pool.stats().shared >= 3

    ca = executor.submit(Request("a", prefix + [1, 2] + done[ua].token_ids + [9, 9], 16), a, share=False)
    cb = executor.submit(Request("b", prefix + [3] + done[ub].token_ids + [8, 8], 16), b, share=False)
    fa = executor.submit(Request("fa", prefix + [1, 2] + done[ua].token_ids + [9, 9], 16), share=False)
    fb = executor.submit(Request("fb", prefix + [3] + done[ub].token_ids + [8, 8], 16), share=False)
    out = _run(executor)
    _assert_same(executor, out[ca], out[fa])
    _assert_same(executor, out[cb], out[fb])


def test_a_full_sequence_prompt_prefills_only_what_the_cache_lacks(llama_tiny):
    executor = _executor(llama_tiny)
    uid = executor.submit(Request("a", encode(executor.tokenizer, "hello there"), 3), share=False)
    first = _run(executor)[uid]
    full = [*first.request.ids, *first.token_ids, *b" again"]
    again = executor.submit(Request("a", full, 4), first.blocks, share=False)
    c = _run(executor)[again]
    # the reply's last token was never fed: it is prefilled with the new ones
    assert (c.prompt_tokens, c.cached_tokens) == (1 + 6, len(first.blocks.token_ids)) == (7, len(full) - 7)
    assert c.text == executor.tokenizer.decode(c.token_ids)


def test_bad_requests_raise_and_leave_the_executor_unchanged(llama_tiny, gemma_tiny):
    executor = _executor(llama_tiny)
    other = _executor(gemma_tiny)
    uid = other.submit(Request("g", [1, 2, 3], 1), share=False)
    foreign = _run(other)[uid].blocks
    busy = executor.submit(Request("busy", [1, 2, 3], 2), share=False)
    before = (executor.in_flight, executor.pool.stats())
    cases = [  # the request's own checks, then the engine's
        (InvalidRequestError, "empty prompt", lambda: executor.submit(Request("a", []))),
        (InvalidRequestError, "empty prompt", lambda: executor.submit(Request("a", encode(executor.tokenizer, "")))),
        (InvalidRequestError, "max_tokens", lambda: executor.submit(Request("a", [1], max_tokens=0))),
        (InvalidRequestError, "vocabulary", lambda: executor.submit(Request("a", [1, 256]))),
        (InvalidRequestError, "vocabulary", lambda: executor.submit(Request("a", [-1]))),
        (InvalidRequestError, "agent_id", lambda: executor.submit(Request("", [1]))),
        (CacheMismatchError, "another cache spec", lambda: executor.submit(Request("a", [*foreign.token_ids, 1]), foreign)),
        (AgentBusyError, "busy", lambda: executor.submit(Request("busy", [1]))),
    ]
    for exc, match, submit in cases:
        with pytest.raises(exc, match=match):
            submit()
        assert (executor.in_flight, executor.pool.stats()) == before
    assert [c.uid for c in executor.step()] == [busy]


def test_extract_cache_covers_tokens_processed_so_far_and_finished_blocks(llama_tiny):
    executor = _executor(llama_tiny)
    prompt = list(range(3, 13))
    uid = executor.submit(Request("a", prompt, 8), share=False)
    steps = executor.step()
    assert executor.extract_cache(uid).token_ids == tuple(prompt[:0])  # queued: nothing processed yet
    done = next(steps)
    assert executor.extract_cache(uid) is done.blocks
    with pytest.raises(UnknownSequenceError):
        executor.extract_cache(uid + 100)


def test_in_flight_extraction_continues_correctly(gemma_tiny):
    executor = _executor(gemma_tiny)
    prompt = list(range(100, 121))
    uid = executor.submit(Request("a", prompt, 20), share=False)
    for _ in range(4):  # prefill and first token, then three more
        assert executor.step_once() == []
    mid = executor.extract_cache(uid)
    assert mid.total_tokens == len(prompt) + 3  # the newest token is read, not fed yet
    rest = list(executor.step())
    assert rest[0].uid == uid
    cont = executor.submit(Request("b", [*mid.token_ids, 1, 2], 8), mid, share=False)
    ref = executor.submit(Request("c", list(mid.token_ids) + [1, 2], 8), share=False)
    out = _run(executor)
    _assert_same(executor, out[cont], out[ref])


def test_a_pool_too_small_for_the_result_keeps_the_tokens_and_says_why(llama_tiny):
    executor = _executor(llama_tiny, blocks=2, block_tokens=4)
    uid = executor.submit(Request("a", list(range(1, 20)), 2), share=False)
    c = _run(executor)[uid]
    assert c.blocks is None and "PoolExhaustedError" in c.cache_error
    assert len(c.token_ids) == 2 and executor.pool.stats().used == 0


def test_stop_tokens_end_a_request(llama_tiny):
    probe = _executor(llama_tiny)
    uid = probe.submit(Request("a", [5, 6, 7], 3), share=False)
    first = _run(probe)[uid].token_ids[0]
    executor = _executor(llama_tiny, stop=[first])
    uid = executor.submit(Request("a", [5, 6, 7], 3), share=False)
    c = _run(executor)[uid]
    assert c.finish_reason == "stop" and c.token_ids == [first]


def test_an_executor_refuses_a_spec_that_is_not_its_models(llama_tiny, gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    with pytest.raises(CacheMismatchError, match="another cache spec"):
        BatchExecutor(llama_tiny, byte_tokenizer(), BlockPool(spec, 4), spec)
    other = ModelCacheSpec.from_model(tiny_gemma3(window=4))
    with pytest.raises(CacheMismatchError):
        BatchExecutor(gemma_tiny, byte_tokenizer(), BlockPool(other, 4), spec)


@pytest.mark.parametrize(
    "which,shared_len,max_tokens,expect_cached",
    [
        ("llama", 13, 3, 13),  # 3 whole blocks, then a's block [12, 16) cut after its first token
        ("gemma", 5, 1, 5),    # 6 tokens <= window 8: every layer still holds block 0, cut at 5
        ("gemma", 13, 3, 13),  # window [5, 13): blocks the prefill's checkpoints pooled, then a's tail cut
    ],
)
def test_a_prompt_reuses_the_longest_pooled_prefix_of_any_agent_and_matches_a_fresh_prefill(
    llama_tiny, gemma_tiny, which, shared_len, max_tokens, expect_cached
):
    model = llama_tiny if which == "llama" else gemma_tiny
    executor = _executor(model)  # block_tokens = 4
    shared = [int(t) for t in np.random.default_rng(5).integers(1, 250, shared_len)]
    uid = executor.submit(Request("a", shared, max_tokens), share=False)
    first = _run(executor)[uid]  # agent a's blocks stay pooled (and hittable even once released)
    prompt = shared + [20, 21, 22, 23, 24]
    b = executor.submit(Request("b", prompt, STEPS))
    ref = executor.submit(Request("ref", prompt, STEPS), share=False)
    done = _run(executor)
    assert (done[b].cached_tokens, done[b].prompt_tokens) == (expect_cached, len(prompt) - expect_cached)
    assert done[ref].cached_tokens == 0
    _assert_same(executor, done[b], done[ref])
    assert first.blocks.total_tokens == shared_len + max_tokens - 1


def test_no_pooled_prefix_means_a_full_prefill(llama_tiny):
    executor = _executor(llama_tiny)
    b = executor.submit(Request("b", list(range(30, 47)), 2))
    assert _run(executor)[b].cached_tokens == 0


def _history(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def _edit(cached: list[int], at: int | None) -> list[int]:
    """``cached`` changed at position ``at`` (cut there, one different token), then a new turn."""
    if at is None:
        return cached + [30, 31, 32, 33, 34]
    return cached[:at] + [(cached[at] + 1) % 250 or 1, 30, 31, 32, 33, 34]


@pytest.mark.parametrize(
    "which,first_len,edit_at,expect_source,expect_cached",
    [
        ("llama", 21, 9, "own-cut", 9),    # global layers: cut exactly at the first difference
        ("llama", 21, None, "own", 26),    # nothing edited: the whole previous cache (21 + 5 of 6 generated)
        ("gemma", 1, 5, "own-cut", 5),     # 6 tokens, window 8 never moved: the cut is exact
        ("gemma", 21, 9, "pool", 9),       # window moved past the cut: the window ending at 9, from blocks pooled at turn 1
        ("gemma", 21, 3, "pool", 3),       # ... pooled block [0, 4) cut after 3 tokens
    ],
)
def test_an_edited_history_reuses_only_what_precedes_the_edit_and_matches_a_fresh_prefill(
    llama_tiny, gemma_tiny, which, first_len, edit_at, expect_source, expect_cached
):
    model = llama_tiny if which == "llama" else gemma_tiny
    executor = _executor(model)  # block_tokens = 4, window 8 for gemma
    uid = executor.submit(Request("a", _history(first_len, first_len), 6))
    first = _run(executor)[uid]
    own = first.blocks
    edited = _edit(list(first.request.ids) + first.token_ids, edit_at)
    b = executor.submit(Request("a", edited, STEPS), own)
    ref = executor.submit(Request("ref", edited, STEPS), share=False)
    done = _run(executor)
    got = done[b]
    assert (got.reuse, got.cached_tokens) == (expect_source, expect_cached)
    assert got.prompt_tokens == len(edited) - expect_cached
    _assert_same(executor, got, done[ref])
    # the new cache is the edited history plus its reply: nothing of the old tail survives
    assert list(got.blocks.token_ids) == edited + got.token_ids[:-1]


def test_a_sliding_edit_reuses_up_to_the_edit_from_the_window_blocks_earlier_prefills_pooled(gemma_tiny):
    executor = _executor(gemma_tiny)
    uid = executor.submit(Request("a", _history(2, 2), 6))
    turn1 = _run(executor)[uid].blocks            # 8 tokens: the window ending at 8 is pooled
    uid = executor.submit(Request("a", list(turn1.token_ids) + _history(9, 13), 6), turn1)
    turn2 = _run(executor)[uid].blocks            # 27 tokens: the window moved to [19, 27)
    del turn1                                   # released; its blocks stay cached in the pool
    edited = _edit(list(turn2.token_ids), 10)
    b = executor.submit(Request("a", edited, STEPS), turn2)
    ref = executor.submit(Request("ref", edited, STEPS), share=False)
    done = _run(executor)
    # turn 2's prefill pooled the window at every block boundary it passed: [2, 10) is pooled
    assert (done[b].reuse, done[b].cached_tokens) == ("pool", 10)
    _assert_same(executor, done[b], done[ref])


def test_the_own_cache_of_a_sliding_layer_is_refused_once_its_window_has_moved_past_the_cut(gemma_tiny):
    executor = _executor(gemma_tiny)
    uid = executor.submit(Request("a", _history(3, 21), 6))
    own = _run(executor)[uid].blocks  # 26 tokens; window 8 holds [18, 26)
    from semantic.cache import convert

    assert convert.covers(own, 26) and not convert.covers(own, 20)
    with pytest.raises(CacheMismatchError):
        convert.reconstruct(own, upto=20)


def test_bad_requests_are_refused_before_touching_state(llama_tiny):
    executor = _executor(llama_tiny)
    with pytest.raises(InvalidRequestError):
        executor.submit(Request("a", [], 2))
    with pytest.raises(InvalidRequestError):
        executor.submit(Request("a", "text is not token ids", 2))
    with pytest.raises(InvalidRequestError):
        executor.submit(Request("a", [1, 2, 999], 2))
    assert executor.in_flight == 0 and executor.pool.stats().used == 0


def test_a_sliding_window_prefix_is_pooled_at_every_block_boundary_so_other_agents_share_it(gemma_tiny):
    executor = _executor(gemma_tiny)  # window 8, block_tokens 4
    system = _history(11, 13)
    a = executor.submit(Request("a", system + _history(12, 17), STEPS))
    ref_a = executor.submit(Request("ref-a", system + _history(12, 17), STEPS), share=False)
    done = _run(executor)
    _assert_same(executor, done[a], done[ref_a])  # pooling a's passed windows changes nothing
    assert (done[a].reuse, done[a].cached_tokens, done[a].prompt_tokens) == ("none", 0, 30)
    b = executor.submit(Request("b", system + [40, 41, 42], STEPS))
    ref_b = executor.submit(Request("ref-b", system + [40, 41, 42], STEPS), share=False)
    done = _run(executor)
    # the window ending at 12 was pooled while a prefilled past it, and a's block [12, 16) starts like b's
    assert (done[b].reuse, done[b].cached_tokens) == ("pool", 13)
    _assert_same(executor, done[b], done[ref_b])


def test_an_agents_turns_run_in_the_pools_own_buffer_and_each_continues_as_a_fresh_prefill(llama_tiny):
    """The first turn's buffer becomes its segment; every later turn is lent it (grown, one layer at a time,
    when it lacks room), writes there in place and leaves its new blocks there: one segment, no copy; and
    each turn's tokens and logprobs are a fresh prefill's."""
    executor = _executor(llama_tiny, blocks=3000)
    ids, own = [int(t) for t in np.random.default_rng(3).integers(1, 250, 300)], None
    for turn in range(4):
        uid = executor.submit(Request("a", ids, 6), own, share=False)
        loan = executor._seqs[uid].loan
        assert bool(loan.lent) == (turn > 0)
        fresh_uid = executor.submit(Request("b", ids, 6), share=False)
        done = _run(executor)
        _assert_same(executor, done[uid], done[fresh_uid])
        if own is not None:
            own.release()
        own, ids = done[uid].blocks, ids + done[uid].token_ids + [7] * (40 + 100 * turn)
        done[fresh_uid].blocks.release()
        assert len({id(b.segment_view.segment) for b in own.groups["global"]}) == 1
    stats = executor.cache_manager.in_place()
    assert stats["groups"] == {"global": True} and stats["lent_turns"] == 3 and stats["grown_segments"] >= 1
