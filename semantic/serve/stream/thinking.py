"""A thinking model's reply, split into reasoning and content at its think markers, as it streams.

mlx-lm's tokenizer wrapper knows a model's markers (``think_start`` /
``think_end``: ``<think>`` / ``</think>`` and the other families). The reply
starts in reasoning when the prompt left a think block open (a template that
ends its generation prompt with ``<think>``), else in content, as
``mlx_lm.server`` decides; each marker switches the state and is never
emitted. A marker's first characters are held back until the next piece
says whether it is one, so the split is the same for every chunking::

    "<think>plan</think>answer"  ->  reasoning "plan", content "answer"
"""

from __future__ import annotations

from semantic.serve.stream.toolcalls import held_back


def opens_in_reasoning(prompt_text: str | None, start: str, end: str) -> bool:
    """Whether the prompt's last think marker is an open one (the reply then starts inside it)."""
    if not prompt_text:
        return False
    return prompt_text.rfind(start) > prompt_text.rfind(end)


class ThinkSplitter:
    """Text in, ``(reasoning, content)`` out; ``finish`` flushes what was held back."""

    def __init__(self, start: str, end: str, reasoning: bool = False):
        assert start and end and start != end
        self.start, self.end, self.reasoning = start, end, reasoning
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        while True:
            marker = self.end if self.reasoning else self.start
            at = self.buffer.find(marker)
            if at == -1:
                keep = held_back(self.buffer, (marker,))
                piece, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if self.reasoning:
                    reasoning += piece
                else:
                    content += piece
                return reasoning, content
            if self.reasoning:
                reasoning += self.buffer[:at]
            else:
                content += self.buffer[:at]
            self.buffer, self.reasoning = self.buffer[at + len(marker):], not self.reasoning

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.reasoning else ("", rest)
