"""Message boundaries in a chat prompt's ids: where the system prompt ends and the last message starts."""

from __future__ import annotations

from harness.models.tiny import CHAT_TEMPLATE, byte_tokenizer
from semantic.chat.boundaries import message_boundaries


def _tok():
    tok = byte_tokenizer()
    tok._tokenizer.chat_template = CHAT_TEMPLATE
    return tok


def _render(tok, msgs, gen):
    return tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def test_the_system_prompts_end_and_the_last_messages_start_are_found_exactly():
    tok = _tok()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    text = _render(tok, msgs, True)
    ids = tok.encode(text, add_special_tokens=False)
    marks = message_boundaries(ids, msgs, text, lambda m: _render(tok, m, False),
                               lambda t: tok.encode(t, add_special_tokens=False))
    system_end = len(tok.encode(_render(tok, msgs[:1], False), add_special_tokens=False))
    last_start = len(tok.encode(_render(tok, msgs[:3], False), add_special_tokens=False))
    assert marks == (system_end, last_start)


def test_a_cut_that_does_not_tokenize_apart_is_left_out_never_guessed():
    tok = _tok()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}]
    text = _render(tok, msgs, True)
    ids = tok.encode(text, add_special_tokens=False)
    shifted = [ids[0] + 1, *ids[1:]]  # the prefix's ids differ: no exact cut from the front
    found = message_boundaries(shifted, msgs, text, lambda m: _render(tok, m, False),
                               lambda t: tok.encode(t, add_special_tokens=False))
    tail = tok.encode(text[len(_render(tok, msgs[:1], False)):], add_special_tokens=False)
    assert found == (len(ids) - len(tail),)  # found from the back instead
    assert message_boundaries(ids, msgs, "something else", lambda m: _render(tok, m, False),
                              lambda t: tok.encode(t, add_special_tokens=False)) == ()
