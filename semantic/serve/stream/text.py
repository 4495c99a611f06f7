"""One turn's text as tokens arrive: incremental detokenization and exact stop-string cuts.

mlx-lm's streaming detokenizer turns tokens into text; a stop string ends
the turn and never reaches the client, even when it spans several tokens, so
the tail that could still begin one is held back until it cannot::

    text so far     "... the answer is 42\n\nUs"      stops: ["\n\nUser:"]
    streamed        "... the answer is 42"          held back: "\n\nUs"
    next token "er:" -> stop found at "\n\nUser:": the turn ends, text cut before it

Runs on the scheduler's worker thread (it is the request's ``on_token``), so
each call is a little string work and, only when logprobs are asked for, a
top-k over the token's row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from semantic.serve.stream.items import Delta, TokenLogprob, TopLogprob
from semantic.serve.stream.thinking import ThinkSplitter
from semantic.serve.stream.toolcalls import CallSplitter, held_back

if TYPE_CHECKING:
    from semantic.service import ToolCall


def stop_cut(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """Where ``text`` must end: the first stop string's start (and which), else len."""
    best, which = len(text), None
    for s in stops:
        i = text.find(s)
        if i != -1 and i < best:
            best, which = i, s
    return best, which


class TextStream:
    """One turn's text as it is generated: detokenized incrementally (mlx-lm's
    streaming detokenizer), cut exactly before the first stop string, and
    held back while its tail could still begin one. With a ``splitter``
    (``stream.toolcalls``) the text is then split into content and tool calls;
    ``quiet_stops`` end the text like stop strings but are not reported as
    one (a tool call the request does not allow). Runs on the worker thread."""

    def __init__(self, tokenizer, stops: tuple[str, ...], logprobs: bool, top: int, eos: frozenset[int],
                 splitter: CallSplitter | None = None, quiet_stops: tuple[str, ...] = (),
                 thinker: ThinkSplitter | None = None):
        self.tokenizer, self.stops, self.want_logprobs, self.top, self.eos = tokenizer, stops, logprobs, top, eos
        self.splitter, self.cuts, self.thinker = splitter, stops + quiet_stops, thinker
        self.reasoning = ""        # what the deltas said of the model's reasoning (a thinking model's)
        self.reasoning_tokens = 0  # tokens generated inside a think block (its closing marker included)
        self.detok = tokenizer.detokenizer
        self.text = ""
        self.sent = 0              # characters of text already in deltas
        self.cut: int | None = None
        self.stopped = False       # a stop string (or a quiet one) ended the text: the turn ends here
        self.stop_sequence: str | None = None
        self.content = ""          # what the deltas said: the reply's text without its tool calls
        self.calls: list[ToolCall] = []
        self.pending: list[TokenLogprob] = []
        self.longest = max((len(s) for s in self.cuts), default=0)

    def feed(self, token: int, logprob: float, row) -> Delta | None:
        # the splitter's state as of the text before this token (a held-back stop prefix can lag it a token)
        self.reasoning_tokens += self.thinker is not None and self.thinker.reasoning and token not in self.eos
        if self.want_logprobs:
            self.pending.append(self._logprob(token, logprob, row))
        if self.cut is None and token not in self.eos:
            self.detok.add_token(token)
            self._grow(self.detok.last_segment)
        return self._delta()

    def finish(self) -> Delta | None:
        if self.cut is None:
            self.detok.finalize()
            self._grow(self.detok.last_segment)
            if self.cut is None:
                self.cut = len(self.text)  # nothing held back any more
        return self._delta(last=True)

    def _grow(self, segment: str) -> None:
        if not segment:
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text += segment
        if self.cuts:
            at, which = stop_cut(self.text[start:], self.cuts)
            if which is not None:
                self.cut, self.stopped = start + at, True
                self.stop_sequence = which if which in self.stops else None

    def _delta(self, last: bool = False) -> Delta | None:
        end = self.cut if self.cut is not None else len(self.text) - held_back(self.text, self.cuts)
        text = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        calls: list[ToolCall] = []
        reasoning = ""
        if self.thinker is not None:  # reasoning first: a tool call inside a think block is only a thought
            reasoning, text = self.thinker.feed(text)
            if last:
                more_reasoning, more_text = self.thinker.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self.splitter is not None:
            text, calls = self.splitter.feed(text)
            if last:
                rest, more = self.splitter.finish()
                text, calls = text + rest, calls + more
        self.content += text
        self.reasoning += reasoning
        self.calls += calls
        if not text and not reasoning and not self.pending and not calls:
            return None
        out, self.pending = Delta(text, self.pending, tool_calls=calls, reasoning=reasoning), []
        return out

    def _logprob(self, token: int, logprob: float, row) -> TokenLogprob:
        import mlx.core as mx

        top = ()
        if self.top:
            idx = mx.argpartition(-row, self.top - 1)[: self.top]
            vals = row[idx]
            pairs = sorted(zip(idx.tolist(), vals.tolist()), key=lambda p: -p[1])
            top = tuple(TopLogprob(*self._piece(t)[:2], float(v), self._piece(t)[2]) for t, v in pairs)
        piece, tid, raw = self._piece(token)
        return TokenLogprob(piece, tid, float(logprob), raw, top)

    def _piece(self, token: int) -> tuple:
        text = self.tokenizer.decode([token])
        return text, int(token), tuple(text.encode("utf-8", "replace"))
