"""System turns inside a conversation, placed where the model's chat template accepts them."""

from __future__ import annotations

from importlib import resources

import pytest
from hypothesis import given, settings, strategies as st

from harness.models.tiny import CHAT_TEMPLATE, byte_tokenizer
from semantic.request import render_text
from semantic.chat.roles import fit, renders_mid_system

pytestmark = pytest.mark.compat


def _tokenizer(template: str):
    tok = byte_tokenizer()
    tok._tokenizer.chat_template = template
    return tok


GEMMA = resources.files("harness.models").joinpath("chat_templates/gemma3.jinja").read_text()


def test_a_template_that_renders_system_turns_anywhere_is_asked_once_and_gets_them_where_they_stand():
    free = _tokenizer(CHAT_TEMPLATE)
    assert renders_mid_system(lambda m: render_text(free, m))
    msgs = [{"role": "user", "content": "u1"}, {"role": "system", "content": "env"}]
    assert fit(msgs, True) == msgs


def test_gemmas_alternating_template_is_not_free_and_gets_early_system_turns_in_its_system_prompt():
    gemma = _tokenizer(GEMMA)
    assert not renders_mid_system(lambda m: render_text(gemma, m))
    # Claude Code's first request: the environment block after the first user turn
    msgs = [{"role": "system", "content": "s0"}, {"role": "user", "content": "u1"}, {"role": "system", "content": "env"}]
    assert fit(msgs, False) == [{"role": "system", "content": "s0\n\nenv"}, {"role": "user", "content": "u1"}]
    assert "s0\n\nenv\n\nu1" in render_text(gemma, fit(msgs, False))


def test_a_system_turn_after_a_reply_joins_the_user_text_beside_it_and_the_earlier_turns_keep_their_text():
    gemma = _tokenizer(GEMMA)
    turn1 = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    turn2 = turn1 + [{"role": "system", "content": "s2"}, {"role": "user", "content": "u3"}]
    assert fit(turn2, False)[-1] == {"role": "user", "content": "u2\n\ns2\n\nu3"}
    first = render_text(gemma, fit(turn1, False), generation_prompt=False)
    second = render_text(gemma, fit(turn2 + [{"role": "assistant", "content": "a2"}], False), generation_prompt=False)
    assert second.startswith(first[: first.index("u2")])  # everything before the changed turn is untouched


ROLE = st.sampled_from(["system", "user", "assistant"])


@settings(max_examples=200, deadline=None)
@given(st.lists(ROLE, min_size=1, max_size=12))
def test_a_fitted_conversation_renders_on_an_alternating_template_and_its_prefix_never_changes(roles):
    """Every placement stays between two replies: the fitted turns up to a reply are the same
    whatever the client appends after it."""
    msgs = [{"role": r, "content": f"{r}{i}"} for i, r in enumerate(roles)]
    fitted = fit(msgs, False)
    assert not any(a["role"] == b["role"] == "user" for a, b in zip(fitted, fitted[1:]))
    assert all(m["role"] != "system" for m in fitted[1:])
    text = " ".join(m["content"] for m in fitted)
    assert all(m["content"] in text for m in msgs)  # nothing is lost
    for cut in [i + 1 for i, m in enumerate(msgs) if m["role"] == "assistant"]:
        head = fit(msgs[:cut], False)
        assert fitted[:len(head)] == head
