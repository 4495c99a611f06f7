"""Speculation on recurrent layers (``semantic.decode.replay``): the same greedy tokens and logprobs as the
same turns without it, in a batch whose rows accept their drafts wholly, in part, or not at all.

A random-weight model seldom agrees with a draft, so besides the real drafter (on prompts that repeat,
which the tiny lfm2 soon echoes) an oracle drafts what the same turn without speculation wrote next,
cut to a random length and sometimes changed at a random place; every step counts what its rows fed
and kept, so no test passes without all three outcomes. The
second turn starts from the pooled blocks of the first: a recurrent state left wrong shows there."""

from __future__ import annotations

import numpy as np
import pytest

from semantic import BatchExecutor, BlockPool, ModelCacheSpec, Request
from semantic.decode import replay
from semantic.decode.promptlookup import Drafter, SpecConfig
from semantic.runner import steploop
from tests.cache_helpers import check, reference
from tests.tiny_models import byte_tokenizer, tiny_lfm2, tiny_qwen3_next

pytestmark = pytest.mark.compat

PROMPTS = {"a": 9, "b": 23, "c": 38, "d": 17}
MODELS = {"lfm2": tiny_lfm2, "qwen3_next": tiny_qwen3_next}


@pytest.fixture(scope="module", params=[*MODELS, "falcon_h1"])
def model(request):
    if request.param in MODELS:
        return MODELS[request.param]()
    from harness.models import zoo  # a recurrent state nested beside attention in one layer (CacheList)

    from semantic.runner.batchprobe import replay_problem

    if request.param not in zoo.model_types():
        pytest.skip(f"this mlx-lm has no {request.param}")
    m = zoo.build(request.param)[0]
    why = replay_problem(m, ModelCacheSpec.from_model(m))
    if why is not None:  # 0.30.4's Mamba-2 scan ignores a row's length: speculation stays off there
        pytest.skip(f"this mlx-lm's {request.param}: {why}")
    return m


def _history(seed: int, n: int) -> list[int]:
    phrase = [int(t) for t in np.random.default_rng(seed).integers(1, 250, 5)]
    return (phrase * n)[:n]


def _executor(model, spec=SpecConfig(max_draft=4)):
    s = ModelCacheSpec.from_model(model)
    return BatchExecutor(model, byte_tokenizer(), BlockPool(s, 2048, block_tokens=4), s,
                         stop_tokens=[], prefill_chunk=8, max_batch=8, speculation=spec)


def oracle(streams: list[list[int]], wrong: float = 0.5) -> type:
    """A drafter class that knows the whole token ``streams`` its sequences follow: it drafts their next
    tokens, of random length, wrong from a random place on in a share ``wrong`` of its drafts."""

    class Oracle(Drafter):
        __slots__ = ("rng",)

        def __init__(self, tokens, config):
            super().__init__(tokens, config)
            self.rng = np.random.default_rng(len(self.tokens))

        def propose(self, room: int) -> list[int]:
            n, toks = int(self.rng.integers(0, min(room, 4) + 1)), self.tokens
            stream = next((s for s in streams if s[: len(toks)] == toks), [])  # none: a turn it does not know
            guess = stream[len(toks) : len(toks) + n]
            if guess and self.rng.random() < wrong:
                at = int(self.rng.integers(0, len(guess)))
                guess = guess[:at] + [(t + 1) % 250 + 1 for t in guess[at:]]
            return guess

    return Oracle


@pytest.fixture
def outcomes(monkeypatch):
    """Each speculative row's (inputs fed, inputs kept), from every step's pending replay."""
    seen = []
    real = replay.Pending.__init__

    def spy(self, rows, kept, inputs, fed, keeps):
        seen.extend(zip(fed, keeps))
        real(self, rows, kept, inputs, fed, keeps)

    monkeypatch.setattr(replay.Pending, "__init__", spy)
    return seen


def _turns(executor, n1=24, n2=10) -> list:
    """Two turns of every prompt in one batch, the second from the first's blocks."""
    hist = {a: _history(i, n) for i, (a, n) in enumerate(PROMPTS.items())}
    uids = {a: executor.submit(Request(a, h, n1)) for a, h in hist.items()}
    first = {c.uid: c for c in executor.step()}
    out = [first[uids[a]] for a in hist]
    uids = {c.request.agent_id: executor.submit(Request(c.request.agent_id, [*c.request.ids, *c.token_ids,
                                                                           *_history(9, 6)], n2), c.blocks)
            for c in out}
    second = {c.uid: c for c in executor.step()}
    return out + [second[uids[a]] for a in hist]


def _assert_same(model, spec_turns, plain_turns):
    """The same tokens with speculation as without; both mlx-lm's own generation, within its measured noise."""
    for s, p in zip(spec_turns, plain_turns):
        assert s.request.ids == p.request.ids and s.token_ids == p.token_ids
        check(model, s, what=f"{s.request.agent_id} speculating")
        check(model, p, what=f"{p.request.agent_id} plain")


def test_drafts_accepted_wholly_in_part_or_not_at_all_leave_a_recurrent_batch_unchanged(model, monkeypatch,
                                                                                         outcomes):
    plain = _turns(_executor(model, spec=None))
    monkeypatch.setattr(steploop, "Drafter", oracle([[*t.request.ids, *t.token_ids] for t in plain]))
    monkeypatch.setattr(steploop, "batch_draft_len", lambda rows, cost: max(n for _, n in rows))
    executor = _executor(model)
    assert executor.speculation_off is None
    _assert_same(model, _turns(executor), plain)
    drafted = [(fed, kept) for fed, kept in outcomes if fed > 1]
    assert any(kept == fed for fed, kept in drafted)          # whole drafts accepted: no replay
    assert any(1 < kept < fed for fed, kept in drafted)       # part of one: replayed
    assert any(kept == 1 for fed, kept in drafted)            # none of it: replayed
    assert any(fed == 1 for fed, _ in outcomes)               # a row without a draft beside drafting ones
    assert executor._loop.replays > 0


def test_real_drafts_on_a_repeating_context_are_accepted_and_change_nothing(model):
    plain = _turns(_executor(model, spec=None))
    executor = _executor(model)
    _assert_same(model, _turns(executor), plain)
    loop = executor._loop
    if model.model_type == "lfm2":  # the tiny lfm2 echoes its repeating prompts: its drafts are taken
        assert loop.spec_steps > 0 and loop.accepted > 0


def test_a_turn_equals_mlx_lms_own_greedy_generation(model, monkeypatch):
    h = _history(7, 30)
    ref = reference(model, h, 16)
    monkeypatch.setattr(steploop, "Drafter", oracle([h + ref.tokens]))
    executor = _executor(model)
    executor.submit(Request("a", h, 16))
    [c] = list(executor.step())
    ref.check(c.token_ids, c.logprobs, "speculating")
    assert executor._loop.accepted > 0


def test_a_stop_string_inside_a_speculative_step_replays_only_up_to_its_token(monkeypatch):
    model = tiny_lfm2()
    h = _history(4, 30)
    plain = _executor(model, spec=None)
    plain.submit(Request("a", h, 20))
    [full] = list(plain.step())
    monkeypatch.setattr(steploop, "Drafter", oracle([h + full.token_ids], wrong=0.0))
    cuts = []
    real_cut = replay.Pending.cut
    monkeypatch.setattr(replay.Pending, "cut", lambda self, row, back: cuts.append(back) or real_cut(self, row, back))
    for cut in range(4, 10):  # one of these ends inside a step that read several tokens
        def stop_at(token, logprob, row, seen=[]):  # noqa: B006 - one counter per engine run
            seen.append(token)
            return len(seen) == cut

        executor = _executor(model)
        executor.submit(Request("a", h, 20, on_token=stop_at))
        [c] = list(executor.step())
        assert c.token_ids == full.token_ids[:cut] and c.finish_reason == "stop"
        assert c.blocks.token_ids == tuple(h + c.token_ids[:-1])  # every token before the stop, nothing after it
        h2 = h + c.token_ids + _history(5, 4)
        executor.submit(Request("a", h2, 6), c.blocks)
        [c2] = list(executor.step())
        assert c2.cached_tokens >= len(h) + cut - 5  # the stop token was never fed
        reference(model, h2, 6).check(c2.token_ids, c2.logprobs, f"after a stop at {cut}")
    assert cuts and all(b > 0 for b in cuts)
