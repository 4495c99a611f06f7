"""The step budget: prompt tokens per step from what steps cost, not a fixed chunk."""

from __future__ import annotations

import numpy as np
import pytest

from semantic import Request
from semantic.runner import lastrow
from semantic.runner.stepbudget import FLOOR, StepBudget
from semantic.runner.steploop import StepLoop
from tests.semantic.runner.test_steploop import _spec

pytestmark = pytest.mark.compat


def test_a_prompt_with_nobody_decoding_gets_the_largest_chunk_and_otherwise_the_device_chunk():
    b = StepBudget(64, solo=2048)
    assert b.tokens(decoding=False) == 2048
    assert b.tokens(decoding=True) == 64


def test_a_fixed_chunk_is_the_same_every_step():
    b = StepBudget(64, itl_target_s=0.2, fixed=16)
    b.observe(0.05, True, 0)
    assert b.tokens(decoding=False) == b.tokens(decoding=True) == 16


def test_the_chunk_beside_decoders_is_what_holds_the_latency_target():
    b = StepBudget(64, itl_target_s=0.200)
    assert b.tokens(decoding=True) == 64      # no costs seen yet: the device's chunk
    b.observe(0.060, True, 0)                 # a decode step alone: 60 ms
    b.observe(0.100, True, 64)                # with 64 prompt tokens: 40 ms more, 0.625 ms a token
    assert b.tokens(decoding=True) == pytest.approx(224, abs=1)  # (200 - 60) / 0.625
    for _ in range(20):                       # the context grew: decode steps now take 150 ms
        b.observe(0.150, True, 0)
    assert b.tokens(decoding=True) == pytest.approx(80, abs=2)
    b.observe(0.5, False, 2048)               # a prefill-only step teaches nothing about decoders
    assert b.tokens(decoding=True) == pytest.approx(80, abs=2)


def test_the_budget_never_stops_a_prompt_nor_exceeds_the_largest_chunk():
    b = StepBudget(64, itl_target_s=0.050, solo=512)
    b.observe(0.080, True, 0)                 # decoding alone already misses the target
    b.observe(0.090, True, 64)
    assert b.tokens(decoding=True) == FLOOR
    fast = StepBudget(64, itl_target_s=10.0, solo=512)
    fast.observe(0.01, True, 0)
    fast.observe(0.01, True, 64)              # prompt tokens seem free
    assert fast.tokens(decoding=True) == 512


class _Counting:
    def __init__(self, model, calls):
        self.model, self.calls = model, calls

    def __call__(self, inputs, cache=None):
        self.calls.append(inputs.shape[1])
        return self.model(inputs, cache=cache)


def _ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def test_a_lone_prompt_prefills_in_one_pass_and_one_beside_a_decoder_in_chunks(llama_tiny):
    calls: list[int] = []
    loop = StepLoop(_Counting(llama_tiny, calls), stop_tokens=[], max_batch=4,
                    prefill_chunk=StepBudget(8, solo=256))
    loop.add(0, Request("a", _ids(1, 100), 30), 0, _spec(llama_tiny, None).make_cache())
    loop.step()
    assert calls == [100]                     # nobody waits on it: one pass, its head on the last row
    calls.clear()
    loop.add(1, Request("b", _ids(2, 40), 2), 0, _spec(llama_tiny, None).make_cache())
    for _ in range(5):
        loop.step()
    assert calls == [1, 8] * 5                # beside a decoder: the decoding chunk per step


def test_a_last_chunk_longer_than_one_pass_pays_for_leaves_its_last_token_to_a_pass_of_its_own(llama_tiny):
    calls: list[int] = []
    loop = StepLoop(_Counting(llama_tiny, calls), stop_tokens=[], max_batch=4,
                    prefill_chunk=StepBudget(8, solo=1024))
    n = lastrow.ONE_PASS_TOKENS + 44
    loop.add(0, Request("a", _ids(1, n), 2), 0, _spec(llama_tiny, None).make_cache())
    loop.step()
    assert calls == [n - 1, 1]                # as mlx-lm's prefill: a pass whose logits are never read, then the last


def test_after_a_prompt_finishes_in_a_lone_step_the_next_one_gets_the_decoding_chunk(llama_tiny):
    calls: list[int] = []
    loop = StepLoop(_Counting(llama_tiny, calls), stop_tokens=[], max_batch=4,
                    prefill_chunk=StepBudget(8, solo=256))
    loop.add(0, Request("a", _ids(1, 20), 4), 0, _spec(llama_tiny, None).make_cache())
    loop.add(1, Request("b", _ids(2, 100), 4), 0, _spec(llama_tiny, None).make_cache())
    loop.step()
    assert calls == [20, 8]                   # a's second token waits for 8 of b's tokens, not 100
