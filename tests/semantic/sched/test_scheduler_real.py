"""The scheduler with real SmolLM2 weights: chat turns rendered by the real
template, a system prompt shared across agents, a turn batched beside
another agent's, and an edited conversation, each against a fresh prefill.

A turn's tokens and logprobs must equal mlx-lm's own generate_step of the
same rendered history (float32 on CPU), within the spread its chunked and
batched variants show on this device (``tests.cache_helpers.reference``, as
in test_executor_real). The system prompt is about 300 tokens, so one whole
256-token block is shared; each reference prefills ~350 tokens, which is
what makes this test take a few minutes on a CPU.
"""

from __future__ import annotations

import pytest

from harness.executors import open_scheduler
from harness.prompts import system_prompt, text_of_tokens
from semantic import ModelCacheSpec, Request, encode, render_chat
from semantic.cache.reuse import common_prefix
from tests.cache_helpers import check

# Not `compat`: under mlx-lm 0.30.4 the tiny models' tests take the same paths through its API (cache classes,
# generate_step, files); these add the real weights' numerics, which do not depend on mlx-lm's version.
pytestmark = [pytest.mark.integration]

STEPS = 8


def _assert_fresh(loaded, result, messages):
    """A turn on the rendered ``messages`` that equals mlx-lm's fresh prefill of them, within its measured noise."""
    assert list(result.request.ids) == render_chat(loaded.tokenizer, messages)
    check(loaded.model, result, spec=ModelCacheSpec.from_model(loaded.model), real=True)


def test_chat_turns_share_prefixes_survive_edits_and_match_fresh_prefills(smollm2, tmp_path):
    tok = smollm2.tokenizer
    system = system_prompt(tok, 300)
    ask = lambda i: {"role": "user", "content": text_of_tokens(tok, 24, 40 * i, f"Question {i}:")}  # noqa: E731
    a = [system, ask(1)]
    b = [system, ask(2)]
    with open_scheduler(smollm2, tmp_path, 64) as sched:
        a1 = sched.submit(Request("a", encode(tok, a), STEPS)).result()
        a2_msgs = a + [{"role": "assistant", "content": a1.text}, ask(3)]
        # b's first turn and a's second run in one batch
        fb, fa = sched.submit(Request("b", encode(tok, b), STEPS)), sched.submit(Request("a", encode(tok, a2_msgs), STEPS))
        b1, a2 = fb.result(), fa.result()
        # the client edits a's first question: everything after it is recomputed
        edited = [system, ask(4), {"role": "assistant", "content": a1.text}, ask(3)]
        a3 = sched.submit(Request("a", encode(tok, edited), STEPS)).result()
        sched.flush()
        assert sched.stats().saves >= 3 and sched.stats().failed == 0

    # a's pooled system prompt: its whole block, and the matching prefix of the block after it
    assert b1.reuse == "pool" and 256 <= b1.cached_tokens < b1.history_tokens
    # the whole first turn at least (the template re-renders the reply; its tokens usually match too)
    assert a2.reuse in ("own", "own-cut") and a2.cached_tokens >= a1.history_tokens
    # cut exactly where the edited message starts to differ from a's cached history
    cut = common_prefix(render_chat(tok, a2_msgs), render_chat(tok, edited))
    assert 256 < cut < a1.history_tokens
    assert (a3.reuse, a3.cached_tokens) == ("own-cut", cut)
    _assert_fresh(smollm2, b1, b)
    _assert_fresh(smollm2, a2, a2_msgs)
    _assert_fresh(smollm2, a3, edited)


def test_gemma_agents_share_a_system_prompt_longer_than_the_sliding_window(gemma3, tmp_path):
    tok = gemma3.tokenizer
    system = system_prompt(tok, 560)  # past the 512-token window: its end is only pooled by checkpoints
    ask = lambda i: {"role": "user", "content": text_of_tokens(tok, 12, 40 * i, f"Question {i}:")}  # noqa: E731
    with open_scheduler(gemma3, tmp_path, 64) as sched:
        a1 = sched.submit(Request("a", encode(tok, [system, ask(1)]), STEPS)).result()
        b1 = sched.submit(Request("b", encode(tok, [system, ask(2)]), STEPS)).result()
    assert (a1.reuse, a1.cached_tokens) == ("none", 0)
    # the window's blocks were pooled at each boundary a's prefill passed; a's tail serves up to the question
    a_ids, b_ids = render_chat(tok, [system, ask(1)]), render_chat(tok, [system, ask(2)])
    assert (b1.reuse, b1.cached_tokens) == ("pool", common_prefix(a_ids, b_ids)) and b1.cached_tokens > 512
    _assert_fresh(gemma3, b1, [system, ask(2)])


def test_gemma_regenerate_edit_and_return_to_a_branch_reuse_up_to_the_divergence(gemma3, tmp_path):
    """Five turns with a 576-token prompt (window 512): cold, append, regenerate,
    the last user message edited, and turn 3 of the first branch. mlx_lm.server reuses
    0 / 584 / 597 / 584 / 606 tokens there; each turn here reuses up to where its history
    parts from something cached, and every reply equals a fresh prefill's."""
    tok = gemma3.tokenizer
    system = system_prompt(tok, 560)
    ask = lambda i: {"role": "user", "content": text_of_tokens(tok, 10, 40 * i, f"Question {i}:")}  # noqa: E731
    said = lambda r: {"role": "assistant", "content": r.text}  # noqa: E731
    t1 = [system, ask(1)]
    with open_scheduler(gemma3, tmp_path, 64) as sched:
        r1 = sched.submit(Request("a", encode(tok, t1), STEPS)).result()
        t2 = t1 + [said(r1), ask(2)]
        r2 = sched.submit(Request("a", encode(tok, t2), STEPS)).result()
        again = sched.submit(Request("a", encode(tok, t2), STEPS)).result()
        edited = t1 + [said(r1), ask(3)]
        r2e = sched.submit(Request("a", encode(tok, edited), STEPS)).result()
        t3 = t2 + [said(r2), ask(4)]
        r3 = sched.submit(Request("a", encode(tok, t3), STEPS)).result()
    ids = {k: render_chat(tok, m) for k, m in (("t1", t1), ("t2", t2), ("edited", edited), ("t3", t3))}
    assert len(ids["t1"]) > 512
    cached = [r.cached_tokens for r in (r1, r2, again, r2e, r3)]
    # what turn 2's cache held (also the regenerate's: greedy): the reply's last token is never fed
    held2 = ids["t2"] + list(r2.token_ids[:-1])
    assert cached == [
        0,
        common_prefix(ids["t2"], ids["t1"] + list(r1.token_ids[:-1])),
        len(ids["t2"]) - 1,                            # all but the token that must be prefilled
        common_prefix(ids["edited"], held2),           # up to the edited message
        common_prefix(ids["t3"], held2),               # the first branch, released twice over, still pooled
    ]
    assert cached[2] > cached[3] > 512 and cached[4] >= len(held2) - 1
    for r, msgs in zip((r1, r2, again, r2e, r3), (t1, t2, t2, edited, t3)):
        _assert_fresh(gemma3, r, msgs)
