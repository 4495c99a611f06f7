"""Constrained decoding in the step loop (llguidance) on tiny random-weight models.

A random model left alone almost never writes JSON; under a grammar it must,
so every output here is checked by parsing it. The parity rule: a free
sequence batched beside a constrained one is bit for bit what it is beside a
free one (same batch shapes at every step, so only the mask differs).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from semantic import BlockPool, BatchExecutor, InvalidRequestError, ModelCacheSpec, Request
from semantic.decode.constraint import Grammar, check
from semantic.decode.sampling import SamplingParams
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _executor(model, stop=(255,), max_batch=8):
    spec = ModelCacheSpec.from_model(model)
    return BatchExecutor(model, byte_tokenizer(), BlockPool(spec, 256, 4), spec, stop_tokens=list(stop),
                                max_batch=max_batch)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def _text(executor, c) -> str:
    return executor.tokenizer.decode([t for t in c.token_ids if t != 255])


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_a_json_schema_grammar_makes_a_random_model_write_a_matching_object_and_stop(llama_tiny, gemma_tiny, which):
    executor = _executor(llama_tiny if which == "llama" else gemma_tiny)
    grammar = Grammar.json_schema(SCHEMA)
    uids = [executor.submit(Request(f"a{i}", _ids(i, 9 + i), 200, grammar=grammar), share=False) for i in range(3)]
    done = {c.uid: c for c in executor.step()}
    for uid in uids:
        c = done[uid]
        assert c.finish_reason == "stop" and len(c.token_ids) < 200  # the grammar ended it, not the budget
        jsonschema.validate(json.loads(_text(executor, c)), SCHEMA)


def test_a_sampled_constrained_sequence_still_matches_its_schema(llama_tiny):
    executor = _executor(llama_tiny)
    grammar = Grammar.json_schema(SCHEMA)
    hot = SamplingParams(temperature=1.0, seed=7)
    uid = executor.submit(Request("s", _ids(3, 12), 200, sampling=hot, grammar=grammar), share=False)
    c = {c.uid: c for c in executor.step()}[uid]
    jsonschema.validate(json.loads(_text(executor, c)), SCHEMA)


def test_a_free_sequence_beside_a_constrained_one_is_bit_for_bit_unchanged(llama_tiny):
    # both neighbours run exactly 20 tokens (the grammar cannot end sooner), so batch shapes match at every step
    long = Grammar.lark('start: /[a-z]{100}/')

    def run(neighbour_grammar):
        executor = _executor(llama_tiny, stop=())
        free = executor.submit(Request("free", _ids(1, 11), 20), share=False)
        other = executor.submit(Request("other", _ids(2, 7), 20, grammar=neighbour_grammar), share=False)
        done = {c.uid: c for c in executor.step()}
        return done[free], done[other], executor

    alone_free, alone_other, _ = run(None)
    beside_free, constrained, executor = run(long)
    assert beside_free.token_ids == alone_free.token_ids
    assert np.array_equal(np.array(beside_free.logprobs), np.array(alone_free.logprobs))  # bit for bit
    assert set(_text(executor, constrained)) <= set("abcdefghijklmnopqrstuvwxyz") and len(constrained.token_ids) == 20
    assert constrained.token_ids != alone_other.token_ids


def test_a_grammar_the_tokenizer_cannot_use_is_refused_before_anything_changes(llama_tiny):
    executor = _executor(llama_tiny)
    bad = Grammar.lark('start: "x" undefined_rule')
    with pytest.raises(InvalidRequestError, match="cannot be used for decoding"):
        check(bad, executor.tokenizer, executor.vocab_size)
    before = executor.pool.stats()
    with pytest.raises(InvalidRequestError, match="cannot be used for decoding"):
        executor.submit(Request("a", [1, 2, 3], 4, grammar=bad))
    assert executor.in_flight == 0 and executor.pool.stats() == before
    with pytest.raises(InvalidRequestError, match="JSON schema must be an object"):
        Grammar.json_schema(["not", "a", "schema"])
    with pytest.raises(InvalidRequestError, match="grammar must be"):
        Request("a", [1], 2, grammar="start: /x/")
