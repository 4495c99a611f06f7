"""Per-token callbacks, early ends (stop, cancel), per-sequence sampling and salted hashes,
on tiny random-weight models.

An early-ended sequence keeps the cache of exactly the tokens it computed: the
next turn from it must equal a fresh prefill (``fresh``), both held against
mlx-lm's own generation within the noise measured beside it (``tests.cache_helpers``).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from semantic import AgentCacheStore, BlockPool, BatchExecutor, ConcurrentScheduler, ModelCacheSpec, Request
from semantic.cache.blockclaim import salt_root_of
from semantic.errors import InvalidRequestError
from semantic.decode.sampling import SamplingParams
from tests.cache_helpers import assert_like_fresh, fresh
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def _executor(model, kv_bits=None, blocks=256, block_tokens=4):
    spec = ModelCacheSpec.from_model(model, kv_bits=kv_bits, kv_group_size=32)
    return BatchExecutor(model, byte_tokenizer(), BlockPool(spec, blocks, block_tokens), spec, stop_tokens=[])


def _scheduler(model, cache_dir, blocks=256, block_tokens=4, **kw):
    spec = ModelCacheSpec.from_model(model)
    store = AgentCacheStore(cache_dir, spec, "tiny", 10**9, pool=BlockPool(spec, blocks, block_tokens))
    return ConcurrentScheduler(model, byte_tokenizer(), store, stop_tokens=[], **kw)


@pytest.fixture(params=["llama", "gemma", "llama-q8"])
def model_and_bits(request, llama_tiny, gemma_tiny):
    return {"llama": (llama_tiny, None), "gemma": (gemma_tiny, None), "llama-q8": (llama_tiny, 8)}[request.param]


def test_on_token_sees_every_token_and_can_end_the_sequence_with_an_exact_cache(model_and_bits):
    model, bits = model_and_bits
    executor = _executor(model, bits)
    history = _ids(3, 23)
    seen = []

    def on_token(token, logprob, logprobs):
        seen.append((token, logprob, logprobs.shape[-1]))
        return len(seen) == 4  # a stop string found in the fourth token

    uid = executor.submit(Request("a", history, 30, on_token=on_token))
    other = executor.submit(Request("b", _ids(4, 9), 12))  # keeps decoding in the same batch
    done = {c.uid: c for c in executor.step()}
    c = done[uid]
    assert c.finish_reason == "stop" and len(c.token_ids) == 4
    assert [t for t, _, _ in seen] == c.token_ids and [lp for _, lp, _ in seen] == c.logprobs
    assert seen[0][2] == executor.vocab_size
    # the stop string's token is never fed: the cache ends right before it
    assert c.blocks is not None and c.blocks.token_ids == tuple(history + c.token_ids[:-1])
    assert len(done[other].token_ids) == 12
    # the kept cache continues exactly like a fresh prefill of the same history
    nxt = history + c.token_ids + _ids(5, 6)
    uid2 = executor.submit(Request("a", nxt, 5), c.blocks)
    c2 = {x.uid: x for x in executor.step()}[uid2]
    assert c2.cached_tokens == len(history) + 3
    again = _executor(model, bits)  # a fresh prefill with the same cache spec (8-bit KV included)
    ref_uid = again.submit(Request("ref", nxt, 5))
    assert_like_fresh(model, c2, {x.uid: x for x in again.step()}[ref_uid], bits)


def test_cancel_ends_a_sequence_in_flight_keeping_what_it_computed(llama_tiny):
    executor = _executor(llama_tiny)
    history = _ids(6, 17)
    uid = executor.submit(Request("a", history, 40))
    for _ in range(3):
        assert executor.step_once() == []
    c = executor.cancel(uid)
    assert c.finish_reason == "cancelled" and len(c.token_ids) == 3
    # everything the model was fed: the newest token was read and streamed, not fed yet
    assert c.blocks.token_ids == tuple(history + c.token_ids[:-1])
    assert executor.in_flight == 0 and executor.cancel(uid) is None
    nxt = history + c.token_ids + [7, 8, 9]
    uid2 = executor.submit(Request("a", nxt, 4), c.blocks)
    c2 = {x.uid: x for x in executor.step()}[uid2]
    assert_like_fresh(llama_tiny, c2, fresh(llama_tiny, nxt, 4))


def test_cancel_before_the_first_token_keeps_no_cache(llama_tiny):
    executor = _executor(llama_tiny)
    uid = executor.submit(Request("a", _ids(7, 30), 5))
    c = executor.cancel(uid)
    assert c.finish_reason == "cancelled" and c.token_ids == [] and c.blocks is None
    assert "before its first token" in c.cache_error
    assert executor.pool.stats().used == 0


def test_a_seed_reproduces_a_sampled_reply_whatever_shares_the_batch(llama_tiny):
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    history = _ids(8, 12)

    def run(neighbours: int, params=hot):
        executor = _executor(llama_tiny)
        uid = executor.submit(Request("s", history, 12, sampling=params))
        for i in range(neighbours):
            executor.submit(Request(f"n{i}", _ids(20 + i, 5 + i), 12, sampling=SamplingParams(temperature=0.7)))
        return {c.uid: c for c in executor.step()}[uid].token_ids

    alone = run(0)
    assert run(3) == alone
    greedy = run(0, SamplingParams())
    assert alone != greedy  # a random model at temperature 1 does not decode its argmax 12 times
    assert run(0, SamplingParams(temperature=1.0, top_p=0.95, seed=99)) != alone


def test_greedy_stays_exact_beside_sampled_and_penalized_sequences(llama_tiny):
    executor = _executor(llama_tiny)
    history = _ids(9, 14)
    g = executor.submit(Request("g", history, 8))
    executor.submit(Request("s", _ids(10, 9), 8, sampling=SamplingParams(temperature=0.9, seed=1)))
    p = executor.submit(Request("p", history, 8, sampling=SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)))
    done = {c.uid: c for c in executor.step()}
    assert_like_fresh(llama_tiny, done[g], fresh(llama_tiny, history, 8))
    assert len(done[p].token_ids) == 8


def test_sampling_params_refuse_out_of_range_values_by_name():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"seed": "x"}, {"top_logprobs": 99},
                {"presence_penalty": 3.0}, {"temperature": float("nan")}, {"top_k": True}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams(repetition_penalty=1.2).greedy


def test_salted_roots_never_share_blocks_but_the_same_salt_does(llama_tiny, cache_dir):
    a, b = salt_root_of("tenant-a"), salt_root_of("tenant-b")
    assert a != b and salt_root_of(None) is None and salt_root_of("") is None
    shared = _ids(11, 24)  # six whole blocks of 4
    with _scheduler(llama_tiny, cache_dir) as sched:
        first = sched.submit(Request("a1", shared + [5], 3, salt_root=a)).result()
        assert first.cached_tokens == 0
        same = sched.submit(Request("a2", shared + [6], 3, salt_root=a)).result()
        assert same.cached_tokens == 24 and same.reuse == "pool"
        other = sched.submit(Request("b1", shared + [7], 3, salt_root=b)).result()
        unsalted = sched.submit(Request("u1", shared + [8], 3)).result()
        assert other.cached_tokens == 0 and unsalted.cached_tokens == 0
        # an agent's own cache under another root is not used either
        moved = sched.submit(Request("a1", shared + [5] + list(first.token_ids) + [9], 3, salt_root=b)).result()
        assert moved.cached_tokens == 24  # b1's blocks, under b
        sched.flush()
    # after a restart the files come back under their own roots
    with _scheduler(llama_tiny, cache_dir) as sched:
        again = sched.submit(Request("a2", shared + [6] + list(same.token_ids) + [1], 3, salt_root=a)).result()
        # a2's reply's last token was never fed
        assert again.reuse == "own" and again.cached_tokens == 25 + len(same.token_ids) - 1
        # a2's file came back keyed under a: a hit for a, a miss for a third root; b finds b1's file
        assert sched.submit(Request("x", shared + [2], 3, salt_root=a)).result().cached_tokens == 24
        assert sched.submit(Request("z", shared + [2], 3, salt_root=salt_root_of("tenant-c"))).result().cached_tokens == 0
        assert sched.submit(Request("y", shared + [2], 3, salt_root=b)).result().cached_tokens == 24
        assert_like_fresh(llama_tiny, again, fresh(llama_tiny, shared + [6] + list(same.token_ids) + [1], 3))


def test_scheduler_streams_cancels_and_keeps_anonymous_turns_out_of_the_store(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir, max_batch=2) as sched:
        history = _ids(12, 21)
        tokens, started = [], threading.Event()
        box = {}

        def on_token(token, logprob, logprobs):
            tokens.append(token)
            if len(tokens) == 3:
                sched.cancel(box["f"])  # from the worker thread itself: takes effect at the next step
            return False

        box["f"] = sched.submit(Request("c", history, 50, on_token=on_token))
        r = box["f"].result(timeout=60)
        assert r.finish_reason == "cancelled" and list(r.token_ids) == tokens[: len(r.token_ids)]
        assert 3 <= len(r.token_ids) <= 4 and r.cache_saved
        # a queued turn cancelled before it runs
        slow = sched.submit(Request("q", history, 30))
        queued = sched.submit(Request("q", history + [1], 30))
        assert sched.cancel(queued) and queued.result().finish_reason == "cancelled"
        slow.result(timeout=60)
        assert not sched.cancel(slow)
        # the cancelled turn's cache is the agent's: its next turn reuses all it fed (or the pool's
        # whole blocks of agent q's identical greedy reply, when they reach further)
        nxt = history + list(r.token_ids) + [4, 5]
        follow = sched.submit(Request("c", nxt, 3)).result()
        assert follow.reuse in ("own", "pool") and follow.cached_tokens >= len(history) + len(r.token_ids) - 1
        assert_like_fresh(llama_tiny, follow, fresh(llama_tiny, nxt, 3))
        # anonymous: pooled prefixes are used, nothing is stored or kept resident
        anon = sched.submit(Request("anon-1", nxt + [6], 3, persist=False)).result()
        assert anon.cached_tokens >= 24
        sched.flush()
        assert "anon-1" not in sched.store.agents() and sched.resident_cache("anon-1") is None
        assert sched.stats().cancelled == 2


def test_a_cancel_landing_while_a_turn_is_admitted_loses_no_other_turn(llama_tiny, cache_dir):
    with _scheduler(llama_tiny, cache_dir) as sched:
        box = {}
        submit = sched.executor.submit

        def admit_then_cancel(*args, **kw):
            # a wrapper, because only here can a cancel land inside _admit's window (after the
            # request was read off the queue, before it is taken off): what a client can race into
            uid = submit(*args, **kw)
            if "first" in box and not box.get("done"):
                box["done"] = sched.cancel(box["first"])
            return uid

        sched.executor.submit = admit_then_cancel
        history = _ids(13, 15)
        box["first"] = sched.submit(Request("r", history, 20))
        second = sched.submit(Request("r", history + [3], 4))
        assert box["first"].result(timeout=60).finish_reason == "cancelled"
        assert len(second.result(timeout=60).token_ids) == 4  # the agent's next turn was not lost
        sched.flush(60)
        stats = sched.stats()
        assert stats.cancelled == 1 and stats.in_flight == 0 and stats.queued == 0
