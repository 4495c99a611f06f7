"""harness.baseline: mlx-lm's BatchGenerator under whichever mlx-lm is installed (make test / make test-compat)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from harness import baseline
from semantic import compat

pytestmark = pytest.mark.compat


def _prefill(model, cache, tokens):
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits)
    return logits[0, -1]


def _canonical(state):
    return compat.temporal_rotating(state) if state.kind == compat.ROTATING else state


def _run(gen, uids):
    tokens = {u: [] for u in uids}
    finished = {}
    while responses := baseline.next_responses(gen):
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
    return tokens, finished


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_finished_cache_holds_prompt_and_every_generated_token(llama_tiny, gemma_tiny, which):
    model = llama_tiny if which == "llama" else gemma_tiny
    prompts = [list(range(3, 14)), list(range(40, 45)), list(range(60, 65))]
    gen = baseline.make_batch_generator(model, max_tokens=6, stop_tokens=[])
    uids = baseline.insert(gen, prompts, [None, None, None], [6, 4, 6])
    tokens, finished = _run(gen, uids)
    for uid, prompt in zip(uids, prompts):
        r = finished[uid]
        assert r.finish_reason == "length"
        assert len(r.cache) == len(model.layers)
        global_layer = next(c for c in r.cache if type(c) is mlx_cache.KVCache)
        held = baseline.finished_cache_tokens(len(prompt), len(tokens[uid]))
        assert global_layer.offset == held
        for c in r.cache:
            if isinstance(c, mlx_cache.RotatingKVCache):  # the whole window survives a wrapped ring
                state = compat.temporal_rotating(compat.read_layer(c))
                assert state.offset == held and state.keys.shape[2] == min(held, c.max_size)


def test_stop_token_ends_a_sequence_with_reason_stop(llama_tiny):
    prompt = list(range(10, 20))
    gen = baseline.make_batch_generator(llama_tiny, max_tokens=5, stop_tokens=[])
    tokens, _ = _run(gen, baseline.insert(gen, [prompt], [None], [5]))
    first = next(iter(tokens.values()))[0]
    gen = baseline.make_batch_generator(llama_tiny, max_tokens=5, stop_tokens={first, 255})
    tokens, finished = _run(gen, baseline.insert(gen, [prompt], [None], [5]))
    (uid,) = finished
    assert tokens[uid] == [first] and finished[uid].finish_reason == "stop"


def test_in_flight_cache_covers_every_reported_token(llama_tiny):
    prompt = list(range(5, 12))
    gen = baseline.make_batch_generator(llama_tiny, max_tokens=10, stop_tokens=[])
    (uid,) = baseline.insert(gen, [prompt], [None], [10])
    reported = 0
    for _ in range(3):
        reported += len(baseline.next_responses(gen))
        cache = baseline.extract_in_flight(gen, uid)
        assert cache[0].offset == baseline.finished_cache_tokens(len(prompt), reported)
    assert baseline.extract_in_flight(gen, uid + 1000) is None
    gen.remove([uid])
    assert baseline.extract_in_flight(gen, uid) is None


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_injected_rebuilt_cache_in_a_batch_matches_a_fresh_prefill(llama_tiny, gemma_tiny, which):
    """A cache read and rebuilt through compat, inserted beside another sequence,
    continues exactly as a fresh prefill of the same tokens (greedy)."""
    model = llama_tiny if which == "llama" else gemma_tiny
    history = list(range(30, 50))  # wraps the tiny Gemma's window of 8
    turn = [7, 8, 9]
    other = list(range(100, 111))

    gen = baseline.make_batch_generator(model, max_tokens=5, stop_tokens=[])
    fresh_uid, other_uid = baseline.insert(gen, [history + turn, other], [None, None], [5, 5])
    fresh, _ = _run(gen, [fresh_uid, other_uid])

    cache = model.make_cache() if hasattr(model, "make_cache") else [mlx_cache.KVCache() for _ in model.layers]
    _prefill(model, cache, history)
    rebuilt = [compat.build_layer(_canonical(compat.read_layer(c))) for c in cache]
    gen = baseline.make_batch_generator(model, max_tokens=5, stop_tokens=[])
    cached_uid, other_uid2 = baseline.insert(gen, [turn, other], [rebuilt, None], [5, 5])
    cached, _ = _run(gen, [cached_uid, other_uid2])

    assert cached[cached_uid] == fresh[fresh_uid]
    assert cached[other_uid2] == fresh[other_uid]
