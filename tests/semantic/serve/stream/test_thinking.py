"""A thinking model's reply split into reasoning and content, the same for every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from semantic.serve.stream.thinking import ThinkSplitter, opens_in_reasoning

pytestmark = pytest.mark.compat


def _split(text: str, cuts: list[int], reasoning: bool = False) -> tuple[str, str]:
    s = ThinkSplitter("<think>", "</think>", reasoning)
    r, c, at = "", "", 0
    for cut in sorted(cuts) + [len(text)]:
        a, b = s.feed(text[at:cut])
        r, c, at = r + a, c + b, cut
    a, b = s.finish()
    return r + a, c + b


def test_markers_switch_between_reasoning_and_content_and_are_never_emitted():
    assert _split("<think>plan it</think>The answer.", []) == ("plan it", "The answer.")
    assert _split("plan it</think>The answer.", [], reasoning=True) == ("plan it", "The answer.")
    assert _split("no markers", []) == ("", "no markers")
    assert _split("still thinking <thi", [], reasoning=True) == ("still thinking <thi", "")
    assert _split("a <thin b", []) == ("", "a <thin b")  # not a marker after all: emitted at the end


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "a", "b c", "<", "/", "think", ">", "\n"]), max_size=20),
       st.lists(st.integers(min_value=0, max_value=200), max_size=8), st.booleans())
def test_every_chunking_splits_the_same_as_the_whole_reply(pieces, cuts, reasoning):
    text = "".join(pieces)
    assert _split(text, [c for c in cuts if c <= len(text)], reasoning) == _split(text, [], reasoning)


def test_a_prompt_that_leaves_a_think_block_open_starts_the_reply_in_reasoning():
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n", "<think>", "</think>")
    assert not opens_in_reasoning("<think>old</think> <|im_start|>assistant\n", "<think>", "</think>")
    assert not opens_in_reasoning(None, "<think>", "</think>")
