"""BlockPoolBatchEngine on tiny random-weight models.

The invariant: generate from S, extract, reconstruct, continue with T; the
result equals a fresh prefill of S + generated + T. Tiny models run in
float32, where a different but equivalent summation order (cached vs. one
long prefill, batch padding) moves a logprob by about 1e-6; 1e-4 leaves room
for that and still catches any wrong or missing token (those move logprobs
by far more than 1e-2 on these models).
"""

from __future__ import annotations

import numpy as np
import pytest

from semantic import (
    AgentBusyError,
    BlockPool,
    BlockPoolBatchEngine,
    CacheMismatchError,
    InvalidRequestError,
    ModelCacheSpec,
    UnknownSequenceError,
)
from tests.tiny_models import byte_tokenizer, tiny_gemma3

LOGPROB_TOL = 1e-4
STEPS = 32


def _engine(model, kv_bits=None, blocks=256, block_tokens=4, stop=()):
    spec = ModelCacheSpec.from_model(model, kv_bits=kv_bits, kv_group_size=32)
    pool = BlockPool(spec, blocks, block_tokens=block_tokens)
    return BlockPoolBatchEngine(model, byte_tokenizer(), pool, spec, stop_tokens=list(stop))


def _run(engine):
    return {c.uid: c for c in engine.step()}


def _assert_same(cached, fresh):
    assert cached.token_ids == fresh.token_ids
    np.testing.assert_allclose(cached.logprobs, fresh.logprobs, atol=LOGPROB_TOL, rtol=0)


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
    engine = _engine(model, kv_bits)
    S = [int(t) for t in np.random.default_rng(history).integers(1, 250, history)]
    T = [11, 12, 13, 14, 15]
    uid = engine.submit("a", S, max_tokens=6)
    first = _run(engine)[uid]
    assert first.blocks.total_tokens == len(S) + 6

    cached_uid = engine.submit("a", T, cache=first.blocks, max_tokens=STEPS)
    fresh_uid = engine.submit("b", S + first.token_ids + T, max_tokens=STEPS)
    done = _run(engine)
    cached, fresh = done[cached_uid], done[fresh_uid]
    assert (cached.prompt_tokens, cached.cached_tokens) == (len(T), len(S) + 6)
    assert fresh.prompt_tokens == len(S) + 6 + len(T)
    assert len(cached.token_ids) == STEPS
    _assert_same(cached, fresh)


def test_a_batch_of_three_finishes_independently_and_each_continues(llama_tiny):
    engine = _engine(llama_tiny)
    prompts = {"x": list(range(30, 37)), "y": list(range(60, 79)), "z": list(range(90, 101))}
    limits = {"x": 5, "y": 2, "z": 8}
    uids = {a: engine.submit(a, p, max_tokens=limits[a]) for a, p in prompts.items()}
    finished = list(engine.step())
    assert [c.agent_id for c in finished] == ["y", "x", "z"]  # yielded as each finishes
    assert {c.agent_id: len(c.token_ids) for c in finished} == limits
    by_agent = {c.agent_id: c for c in finished}
    assert all(by_agent[a].uid == uids[a] for a in prompts)

    more = [5, 6, 7]
    cont = {a: engine.submit(a, more, cache=by_agent[a].blocks, max_tokens=12) for a in prompts}
    ref = {a: engine.submit(f"{a}-fresh", prompts[a] + by_agent[a].token_ids + more, max_tokens=12) for a in prompts}
    done = _run(engine)
    for a in prompts:
        _assert_same(done[cont[a]], done[ref[a]])


def test_two_agents_with_a_common_prefix_hold_it_once_and_both_continue(gemma_tiny):
    engine = _engine(gemma_tiny, block_tokens=4)
    prefix = list(range(40, 52))  # 3 full blocks of 4
    ua = engine.submit("a", prefix + [1, 2], max_tokens=2)
    ub = engine.submit("b", prefix + [3], max_tokens=2)
    done = _run(engine)
    a, b = done[ua].blocks, done[ub].blocks
    shared = [x for x in a.groups["global"][:3]]
    assert shared == b.groups["global"][:3]
    assert [engine.pool.refcount(x) for x in shared] == [2, 2, 2]
    assert engine.pool.stats().shared >= 3

    ca = engine.submit("a", [9, 9], cache=a, max_tokens=16)
    cb = engine.submit("b", [8, 8], cache=b, max_tokens=16)
    fa = engine.submit("fa", prefix + [1, 2] + done[ua].token_ids + [9, 9], max_tokens=16)
    fb = engine.submit("fb", prefix + [3] + done[ub].token_ids + [8, 8], max_tokens=16)
    out = _run(engine)
    _assert_same(out[ca], out[fa])
    _assert_same(out[cb], out[fb])


def test_a_full_sequence_prompt_prefills_only_what_the_cache_lacks(llama_tiny):
    engine = _engine(llama_tiny)
    uid = engine.submit("a", "hello there", max_tokens=3)
    first = _run(engine)[uid]
    full = list(first.blocks.token_ids) + list(b" again")
    again = engine.submit("a", full, cache=first.blocks, max_tokens=4)
    c = _run(engine)[again]
    assert (c.prompt_tokens, c.cached_tokens) == (6, len(first.blocks.token_ids))
    assert c.text == engine.tokenizer.decode(c.token_ids)


def test_bad_requests_raise_and_leave_the_engine_unchanged(llama_tiny, gemma_tiny):
    engine = _engine(llama_tiny)
    other = _engine(gemma_tiny)
    uid = other.submit("g", [1, 2, 3], max_tokens=1)
    foreign = _run(other)[uid].blocks
    busy = engine.submit("busy", [1, 2, 3], max_tokens=2)
    before = (engine.in_flight, engine.pool.stats())
    cases = [
        (InvalidRequestError, "empty prompt", dict(agent_id="a", prompt=[])),
        (InvalidRequestError, "empty prompt", dict(agent_id="a", prompt="")),
        (InvalidRequestError, "max_tokens", dict(agent_id="a", prompt=[1], max_tokens=0)),
        (InvalidRequestError, "vocabulary", dict(agent_id="a", prompt=[1, 256])),
        (InvalidRequestError, "vocabulary", dict(agent_id="a", prompt=[-1])),
        (InvalidRequestError, "agent_id", dict(agent_id="", prompt=[1])),
        (CacheMismatchError, "another cache spec", dict(agent_id="a", prompt=[1], cache=foreign)),
        (AgentBusyError, "busy", dict(agent_id="busy", prompt=[1])),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            engine.submit(**kw)
        assert (engine.in_flight, engine.pool.stats()) == before
    assert [c.uid for c in engine.step()] == [busy]


def test_extract_cache_covers_tokens_processed_so_far_and_finished_blocks(llama_tiny):
    engine = _engine(llama_tiny)
    prompt = list(range(3, 13))
    uid = engine.submit("a", prompt, max_tokens=8)
    steps = engine.step()
    assert engine.extract_cache(uid).token_ids == tuple(prompt[:0])  # queued: nothing processed yet
    done = next(steps)
    assert engine.extract_cache(uid) is done.blocks
    with pytest.raises(UnknownSequenceError):
        engine.extract_cache(uid + 100)


def test_in_flight_extraction_continues_correctly(gemma_tiny):
    engine = _engine(gemma_tiny)
    prompt = list(range(100, 121))
    uid = engine.submit("a", prompt, max_tokens=20)
    for _ in range(4):  # prefill and first token, then three more
        assert engine.step_once() == []
    mid = engine.extract_cache(uid)
    assert mid.total_tokens == len(prompt) + 4
    rest = list(engine.step())
    assert rest[0].uid == uid
    cont = engine.submit("b", [1, 2], cache=mid, max_tokens=8)
    ref = engine.submit("c", list(mid.token_ids) + [1, 2], max_tokens=8)
    out = _run(engine)
    _assert_same(out[cont], out[ref])


def test_a_pool_too_small_for_the_result_keeps_the_tokens_and_says_why(llama_tiny):
    engine = _engine(llama_tiny, blocks=2, block_tokens=4)
    uid = engine.submit("a", list(range(1, 20)), max_tokens=2)
    c = _run(engine)[uid]
    assert c.blocks is None and "PoolExhaustedError" in c.cache_error
    assert len(c.token_ids) == 2 and engine.pool.stats().used == 0


def test_stop_tokens_end_a_request(llama_tiny):
    probe = _engine(llama_tiny)
    uid = probe.submit("a", [5, 6, 7], max_tokens=3)
    first = _run(probe)[uid].token_ids[0]
    engine = _engine(llama_tiny, stop=[first])
    uid = engine.submit("a", [5, 6, 7], max_tokens=3)
    c = _run(engine)[uid]
    assert c.finish_reason == "stop" and c.token_ids == [first]


def test_an_engine_refuses_a_spec_that_is_not_its_models(llama_tiny, gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    with pytest.raises(CacheMismatchError, match="another cache spec"):
        BlockPoolBatchEngine(llama_tiny, byte_tokenizer(), BlockPool(spec, 4), spec)
    other = ModelCacheSpec.from_model(tiny_gemma3(window=4))
    with pytest.raises(CacheMismatchError):
        BlockPoolBatchEngine(gemma_tiny, byte_tokenizer(), BlockPool(other, 4), spec)


@pytest.mark.parametrize(
    "which,shared_len,max_tokens,expect_cached",
    [
        ("llama", 13, 3, 12),  # 3 whole blocks of the 13 shared tokens
        ("gemma", 5, 1, 4),    # 6 tokens <= window 8: every layer still holds block 0
        ("gemma", 13, 3, 0),   # window moved past [4, 12): refused, not approximated
    ],
)
def test_a_prompt_reuses_the_longest_pooled_prefix_of_any_agent_and_matches_a_fresh_prefill(
    llama_tiny, gemma_tiny, which, shared_len, max_tokens, expect_cached
):
    model = llama_tiny if which == "llama" else gemma_tiny
    engine = _engine(model)  # block_tokens = 4
    shared = [int(t) for t in np.random.default_rng(5).integers(1, 250, shared_len)]
    uid = engine.submit("a", shared, max_tokens=max_tokens)
    first = _run(engine)[uid]  # agent a's blocks stay pooled (and hittable even once released)
    prompt = shared + [20, 21, 22, 23, 24]
    b = engine.submit("b", prompt, max_tokens=STEPS, reuse_prefix=True)
    ref = engine.submit("ref", prompt, max_tokens=STEPS)
    done = _run(engine)
    assert (done[b].cached_tokens, done[b].prompt_tokens) == (expect_cached, len(prompt) - expect_cached)
    assert done[ref].cached_tokens == 0
    _assert_same(done[b], done[ref])
    assert first.blocks.total_tokens == shared_len + max_tokens


def test_no_pooled_prefix_means_a_full_prefill(llama_tiny):
    engine = _engine(llama_tiny)
    b = engine.submit("b", list(range(30, 47)), max_tokens=2, reuse_prefix=True)
    assert _run(engine)[b].cached_tokens == 0
