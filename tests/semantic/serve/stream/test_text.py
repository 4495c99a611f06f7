"""TextStream: streamed text never shows a stop string, even one split over tokens.

The byte tokenizer makes each byte one token, so a stop string always spans
several tokens and a two-byte character arrives in halves.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from semantic.serve.stream.text import TextStream, stop_cut
from semantic.serve.stream.toolcalls import held_back
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

EOS = 255


def _run(text: str, stops=(), logprobs=False, top=0, eos_at_end=False):
    tok = byte_tokenizer()
    stream = TextStream(tok, tuple(stops), logprobs, top, frozenset([EOS]))
    row = mx.log(mx.ones((256,)) / 256)
    deltas, ended_at = [], None
    ids = list(text.encode()) + ([EOS] if eos_at_end else [])
    for i, t in enumerate(ids):
        d = stream.feed(t, -1.0, row)
        if d is not None:
            deltas.append(d)
        if stream.stopped:
            ended_at = i
            break
    tail = stream.finish()
    if tail is not None:
        deltas.append(tail)
    return stream, deltas, ended_at


def test_a_stop_string_spanning_tokens_is_cut_exactly_and_never_streamed():
    stream, deltas, ended = _run("The answer is 42.\n\nUser: more", stops=["\n\nUser:"])
    assert "".join(d.text for d in deltas) == "The answer is 42."
    assert stream.stop_sequence == "\n\nUser:" and ended == len("The answer is 42.\n\nUser:") - 1
    assert all("\n" not in d.text for d in deltas)  # the held-back "\n\n" was never sent


def test_a_tail_that_only_looked_like_a_stop_is_released():
    stream, deltas, _ = _run("a\n\nUse it", stops=["\n\nUser:"])
    assert not stream.stopped and "".join(d.text for d in deltas) == "a\n\nUse it"


def test_the_earliest_of_several_stops_wins_and_eos_adds_no_text():
    stream, deltas, _ = _run("x END y STOP", stops=["STOP", "END"])
    assert stream.stop_sequence == "END" and "".join(d.text for d in deltas) == "x "
    stream, deltas, _ = _run("héllo wörld", eos_at_end=True)
    assert "".join(d.text for d in deltas) == "héllo wörld"  # two-byte characters arrive whole


def test_logprobs_come_with_their_tokens_and_top_alternatives():
    _, deltas, _ = _run("ab", logprobs=True, top=3)
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == [97, 98] and all(lp.logprob == -1.0 for lp in lps)
    assert all(len(lp.top) == 3 for lp in lps) and lps[0].bytes == (97,)


def test_stop_cut_and_held_back():
    assert stop_cut("abcSTOPdef", ["STOP", "def"]) == (3, "STOP")
    assert stop_cut("abc", ["x"]) == (3, None)
    assert held_back("abc\n\nU", ["\n\nUser:"]) == 3 and held_back("abc", ["\n\nUser:"]) == 0
