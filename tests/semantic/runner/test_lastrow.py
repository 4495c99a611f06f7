"""A chunk's last row of logits, from the model's own call with its body cut to the last position."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from harness import noise
from semantic.runner.lastrow import last_logits
from tests.tiny_models import tiny_gemma3, tiny_lfm2, tiny_llama

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3, tiny_lfm2])
def test_the_last_row_equals_the_full_logits_last_row_and_the_cache_takes_every_token(make):
    model = make()
    ids = mx.array([list(range(3, 24))])
    full, cut, chunked = model.make_cache(), model.make_cache(), model.make_cache()
    want = model(ids, cache=full)[:, -1, :]
    got = last_logits(model, ids, cut)
    model(ids[:, :11], cache=chunked)  # one more correct computation: the same tokens in two chunks
    other = model(ids[:, 11:], cache=chunked)[:, -1, :]
    assert got.shape == want.shape == (1, model.args.vocab_size)
    noise.assert_within(np.array(got), np.array(want), noise.spread(np.array(other), np.array(want)), "last row")
    nxt = mx.array([[5]])  # and both caches continue alike
    after_full, after_chunked = np.array(model(nxt, cache=full)), np.array(model(nxt, cache=chunked))
    noise.assert_within(np.array(model(nxt, cache=cut)), after_full, noise.spread(after_chunked, after_full),
                        "the next step after it")


def test_the_body_is_the_models_own_again_after_the_call_even_one_that_raised():
    model = tiny_llama()
    body = model.model
    with pytest.raises(Exception):
        last_logits(model, mx.array([[1, 2]]), ["not a cache"])
    assert model.model is body and "model" not in model.__dict__
    last_logits(model, mx.array([[1, 2]]), model.make_cache())
    assert model.model is body and list(model.keys()) == list(tiny_llama().keys())


def test_a_model_without_a_body_attribute_gets_every_row_cut_after():
    calls = []

    def model(tokens, cache=None):
        calls.append(tokens.shape)
        return mx.broadcast_to(mx.arange(tokens.shape[1])[None, :, None], (1, tokens.shape[1], 4))

    assert last_logits(model, mx.array([[1, 2, 3]]), None).tolist() == [[2, 2, 2, 2]]
    assert calls == [(1, 3)]
