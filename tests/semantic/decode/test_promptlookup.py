"""Prompt-lookup speculation: the same greedy tokens, logprobs and caches as one token a step.

The reference is mlx-lm's own ``generate_step`` (as in ``test_steploop``), its logprobs
compared within the noise measured beside it (``tests.cache_helpers.reference``).
Any draft at all must leave the output unchanged, so besides the real
drafter the loop is also run with a noisy one (drafts of random length,
some tokens wrong): rows then keep different counts in the same step, which
is the hard part of taking rejected tokens back out of a batch
(``semantic.decode.rewind``). The second turn starts from the pooled blocks of the
first, so a cache left wrong by a rewind shows there.
"""

from __future__ import annotations

import numpy as np
import pytest

from semantic import BatchExecutor, BlockPool, ModelCacheSpec, Request
from semantic.runner import steploop
from semantic.decode import rewind
from semantic.decode.promptlookup import Drafter, SpecConfig, batch_draft_len
from semantic.decode.sampling import SamplingParams
from tests.cache_helpers import reference
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

# repeated 5-token phrases: the tiny models' replies soon repeat too, so real drafts are accepted
PROMPTS = {"a": 9, "b": 23, "c": 38}


def _history(seed: int, n: int) -> list[int]:
    phrase = [int(t) for t in np.random.default_rng(seed).integers(1, 250, 5)]
    return (phrase * n)[:n]


def _executor(model, bits, chunk=8, spec=SpecConfig(max_draft=4)):
    s = ModelCacheSpec.from_model(model, kv_bits=bits, kv_group_size=32)
    return BatchExecutor(model, byte_tokenizer(), BlockPool(s, 1024, block_tokens=4), s,
                                stop_tokens=[], prefill_chunk=chunk, max_batch=8, speculation=spec)


class NoisyDrafter(Drafter):
    """Drafts of random length whose tokens are sometimes wrong: rows accept different counts."""

    __slots__ = ("rng",)

    def __init__(self, tokens, config):
        super().__init__(tokens, config)
        self.rng = np.random.default_rng(len(self.tokens))

    def propose(self, room: int) -> list[int]:
        n = int(self.rng.integers(0, min(room, 4) + 1))
        toks = self.tokens
        at = self._index[2].get(tuple(toks[-2:]))
        guess = toks[at : at + n] if at is not None else []
        guess = guess + [int(t) for t in self.rng.integers(1, 250, n - len(guess))]
        return [int(self.rng.integers(1, 250)) if self.rng.random() < 0.3 else t for t in guess]


@pytest.fixture(params=["llama", "llama-q8", "gemma", "gemma-q8"])
def model_and_bits(request, llama_tiny, gemma_tiny):
    name, _, q = request.param.partition("-q")
    return (llama_tiny if name == "llama" else gemma_tiny), (int(q) if q else None)


@pytest.fixture
def ragged(monkeypatch):
    """Count the steps whose rows kept different numbers of tokens."""
    seen = {"ragged": 0}
    real = rewind.rewind

    def counting(batch, drop):
        seen["ragged"] += len(set(drop)) > 1
        real(batch, drop)

    monkeypatch.setattr(rewind, "rewind", counting)
    return seen


def _two_turns(executor, model, bits, n1=24, n2=10):
    hist = {a: _history(i, n) for i, (a, n) in enumerate(PROMPTS.items())}
    uids = {a: executor.submit(Request(a, h, n1)) for a, h in hist.items()}
    first = {c.uid: c for c in executor.step()}
    nxt = {}
    for a, h in hist.items():
        c = first[uids[a]]
        reference(model, h, n1, bits).check(c.token_ids, c.logprobs, f"{a} first turn")
        assert c.blocks.token_ids == tuple(h + c.token_ids[:-1])  # the last token is never fed
        nxt[a] = (h + c.token_ids + _history(9 + len(a), 6), c.blocks)
    uids = {a: executor.submit(Request(a, h, n2), own) for a, (h, own) in nxt.items()}
    second = {c.uid: c for c in executor.step()}
    for a, (h, _) in nxt.items():
        c = second[uids[a]]
        assert c.cached_tokens >= len(h) - 7  # all but the new tokens and the reply's last one, never fed
        reference(model, h, n2, bits).check(c.token_ids, c.logprobs, f"{a} second turn")


@pytest.mark.parametrize("chunk", [3, 64])
def test_speculation_keeps_greedy_tokens_logprobs_and_caches_for_every_cache_type(model_and_bits, chunk):
    model, bits = model_and_bits
    executor = _executor(model, bits, chunk)
    _two_turns(executor, model, bits)
    loop = executor._loop
    assert loop.spec_steps > 0 and loop.accepted > 0  # the tiny models repeat: drafts were taken


def test_any_drafts_at_all_leave_the_output_unchanged(model_and_bits, monkeypatch, ragged):
    model, bits = model_and_bits
    monkeypatch.setattr(steploop, "Drafter", NoisyDrafter)
    monkeypatch.setattr(steploop, "batch_draft_len", lambda rows, cost: max(n for _, n in rows))  # every draft whole
    executor = _executor(model, bits)
    _two_turns(executor, model, bits)
    loop = executor._loop
    assert loop.drafted > loop.accepted > 0  # drafts were both taken and refused ...
    assert ragged["ragged"] > 3              # ... by rows of one step in different numbers


def test_a_stop_string_inside_a_speculative_step_keeps_the_cache_of_exactly_its_tokens(llama_tiny, gemma_tiny):
    for model in (llama_tiny, gemma_tiny):
        h = _history(4, 30)
        plain = _executor(model, None, spec=None)
        plain.submit(Request("a", h, 20))
        [full] = list(plain.step())
        cut = 7  # ends inside a step that read several tokens

        def stop_at(token, logprob, row, seen=[]):  # noqa: B006 - one counter per engine run
            seen.append(token)
            return len(seen) == cut

        executor = _executor(model, None)
        executor.submit(Request("a", h, 20, on_token=stop_at))
        [c] = list(executor.step())
        assert executor._loop.accepted > 0
        assert c.token_ids == full.token_ids[:cut] and c.finish_reason == "stop"
        assert c.blocks.token_ids == tuple(h + c.token_ids[:-1])  # every token before the stop, nothing after it
        h2 = h + c.token_ids + _history(5, 4)
        executor.submit(Request("a", h2, 6), c.blocks)
        [c2] = list(executor.step())
        assert c2.cached_tokens >= len(h) + cut - 5  # the stop token was never fed
        reference(model, h2, 6).check(c2.token_ids, c2.logprobs, "after the stop")


def test_sampled_and_penalized_neighbours_never_draft_and_change_nothing_for_a_greedy_row(llama_tiny):
    h = _history(1, 23)
    executor = _executor(llama_tiny, None)
    executor.submit(Request("greedy", h, 16))
    executor.submit(Request("sampled", _history(2, 23), 16, sampling=SamplingParams(temperature=0.8, seed=3)))
    executor.submit(Request("penalized", _history(3, 23), 16, sampling=SamplingParams(repetition_penalty=1.3)))
    drafting = {}
    real = executor._loop._propose

    def spy(seq):
        out = real(seq)
        drafting.setdefault(seq.uid, []).append(len(out))
        return out

    executor._loop._propose = spy
    done = {c.request.agent_id: c for c in executor.step()}
    reference(llama_tiny, h, 16).check(done["greedy"].token_ids, done["greedy"].logprobs, "greedy")
    by_uid = {c.uid: c.request.agent_id for c in done.values()}
    drafted = {by_uid[u]: sum(n) for u, n in drafting.items()}
    assert drafted["greedy"] > 0 and drafted["sampled"] == 0 and drafted["penalized"] == 0


# ---------------------------------------------------------------- the drafter


def test_a_draft_copies_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    d = Drafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3], SpecConfig(max_draft=3, ngram=2, min_ngram=2))
    assert d.propose(10) == [7, 8, 2]      # "2 3" last seen before "7 8 2", not before "4 5 9"
    d.extend([7])
    assert d.propose(10) == [8, 2, 3]      # "3 7": continues from there
    assert d.propose(1) == [8]             # never more than the budget leaves
    assert Drafter([1, 2, 3, 4], SpecConfig(ngram=2, min_ngram=2)).propose(5) == []  # no match


def _alone(d: Drafter, room: int = 50) -> list[int]:
    """One sequence's draft when it decodes alone: its guess, cut to the bet that pays."""
    guess = d.propose(room)
    return guess[: batch_draft_len([(d.rate, len(guess))], d.config.position_cost)]


def test_a_drafter_whose_drafts_fail_stops_drafting_and_tries_again_later():
    d = Drafter([1, 2] * 20, SpecConfig(max_draft=8, ngram=2, min_ngram=2, position_cost=0.15))
    assert len(_alone(d)) > 1
    for _ in range(6):
        d.record(len(_alone(d)) or 1, 0)
    assert _alone(d) == []                 # nothing pays at this acceptance rate: no draft, no cost
    tries = 0
    while not _alone(d):
        tries += 1
    assert 5 < tries < 200                 # the evidence fades, and it bets again


def test_truncating_a_drafter_forgets_the_occurrences_after_the_cut():
    d = Drafter([5, 6, 7, 5, 6, 8], SpecConfig(ngram=2, min_ngram=2))
    d.truncate(4)
    assert d.tokens == [5, 6, 7, 5]
    d.extend([6])
    assert d.propose(5)[:1] == [7]           # "5 6" was followed by 7, the 8 was forgotten


@pytest.mark.parametrize("p, cost, expected", [(0.95, 0.15, 8), (0.9, 0.15, 6), (0.5, 0.15, 2), (0.15, 0.15, 0), (0.99, 0.0, 8)])
def test_the_draft_length_is_the_bet_with_the_most_tokens_per_cost(p, cost, expected):
    assert batch_draft_len([(p, 8)], cost) == expected


def test_a_batch_drafts_as_far_as_its_rows_together_pay_for():
    sure = (0.95, 8)
    assert batch_draft_len([sure], 0.15) == 8
    together = batch_draft_len([sure] * 4, 0.15)
    assert together >= 6                                      # every row gains from every position
    assert batch_draft_len([sure, (0.0, 0), (0.0, 0), (0.0, 0)], 0.15) < together  # three rows only pay
    assert batch_draft_len([(0.3, 8)] + [(0.0, 0)] * 7, 0.15) == 0
    assert batch_draft_len([(0.0, 0)] * 3, 0.15) == 0         # nothing to draft: a plain step


def test_speculation_settings_are_checked():
    with pytest.raises(ValueError):
        SpecConfig(max_draft=0)
    with pytest.raises(ValueError):
        SpecConfig(ngram=1, min_ngram=2)
