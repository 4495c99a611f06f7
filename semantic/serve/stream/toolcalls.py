"""A reply's text split into content and tool calls as it streams: no marker ever reaches the content.

Native formats wrap each call in markers; text that could still begin one is
held back, the way a stop string's first characters are (``stream.text``)::

    text so far       "Let me check.<tool_c"          start marker "<tool_call>"
    content           "Let me check."                  held back: "<tool_c"
    next "all>\\n{...}\\n</tool_call>"   -> a call (mlx-lm's parser), then content again

A generic-format reply (``semantic.chat.toolformat``) is a call when its first
character is "{", and content otherwise. A complete call that does not parse
is kept as content, markers and all: the client sees what the model wrote; a
call the reply's end cut short (its token budget) is dropped, never shown.
"""

from __future__ import annotations

import logging
import secrets

from typing import Sequence

from semantic.service import ToolCall, ToolReading, read_calls

log = logging.getLogger(__name__)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still begin a stop string (not streamed yet)."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


class CallSplitter:
    """Splits one reply into content and :class:`ToolCall` s (see the module doc)."""

    def __init__(self, reading: ToolReading, id_prefix: str = "call_"):
        self.reading, self.id_prefix = reading, id_prefix
        self.buffer = ""            # text not yet emitted: a possible marker's start, or a call's body
        self.in_call = False
        self.decided = reading.format.native  # a generic reply is content or a call from its first character
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content to emit, and the calls completed by ``text``."""
        self.buffer += text
        if not self.reading.format.native:
            return self._generic()
        out, calls = "", []
        while True:
            fmt = self.reading.format
            if not self.in_call:
                at = self.buffer.find(fmt.start)
                if at == -1:
                    keep = held_back(self.buffer, (fmt.start,))
                    out += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out, calls
                out += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(fmt.start):], True
            if fmt.end is None:
                return out, calls  # the call runs to the end of the reply (Mistral)
            at = self.buffer.find(fmt.end)
            if at == -1:
                return out, calls
            body, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(fmt.end):], False
            parsed = self._parse(body)
            if parsed is None:
                out += fmt.start + body + fmt.end
            calls += parsed or []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply: held-back text, or a call that ran to its end
        (Mistral's have no end marker); one that does not parse was cut short: dropped."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        return "", self._parse(rest) or []

    def _generic(self) -> tuple[str, list[ToolCall]]:
        if not self.decided:
            stripped = self.buffer.lstrip()
            if not stripped:
                return "", []
            self.decided, self.in_call = True, stripped.startswith("{")
        if self.in_call:
            return "", []  # the whole reply is one JSON object: read at the end
        out, self.buffer = self.buffer, ""
        return out, []

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            found = read_calls(body, self.reading)
        except (ValueError, TypeError) as exc:
            log.warning("a tool call did not parse (%s): kept as text", exc)
            return None
        calls = [ToolCall(self.id_prefix + secrets.token_hex(12), c["name"], c["arguments"]) for c in found]
        if not self.reading.tools.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        return calls
