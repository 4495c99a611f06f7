"""Echo-stable history: a reply the client sends back is the token ids the model generated, not a re-render.

An agent's cache holds its last prompt and every token it generated. A chat
client sends that reply back as a message (text, or structured tool calls),
and the chat template renders it again: for tool calls almost never into the
same tokens (JSON spacing, argument order, a template's own layout), so the
cache would be cut at the reply's first token on every turn of a tool loop.
Instead, when the echoed reply is the one this server generated for that
agent and everything before it is unchanged, the prompt is the cache's own
ids, then the template's text from the end of the reply on::

    last turn     prompt text P ─► ids(P) + generated G          (what the cache holds)
    this turn     [ messages up to the reply | the reply | new messages ]
                    renders to P ✓             == what we said ✓
    prompt ids    ids(P) + G + encode(template's text after the reply's end-of-turn)

The template's own rendering of the reply is dropped whatever it is, so a
thinking model's reply stays a hit even under a template that strips old
reasoning from history (the cache keeps the reasoning as generated).

The book keeps each agent's last few turns (:data:`TURNS`), newest first: a client that
regenerates, or goes back to an earlier branch, echoes a reply older than the last one.
The service keeps each agent's last :class:`Said` beside its cache file too
(``AgentCacheStore.save_extra``), so a restart's first turn splices as the
next turn would have. Anything else (an edit, another client's history)
renders as usual; the executor verifies every reused token either way, so the rendered
form is always safe, only slower. ``EchoBook.spliced`` / ``rendered`` count
the two paths.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True, slots=True)
class Reply:
    """An assistant message as a client echoes it: its text and its calls (name, canonical arguments)."""

    text: str
    calls: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, message: dict) -> "Reply":
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in message.get("tool_calls") or ())
        return cls(message.get("content") or "", calls)


@dataclass(frozen=True, slots=True)
class Said:
    """An agent's last turn as this server generated it."""

    prompt_text: str            # the template's text of that turn's prompt
    ids: tuple[int, ...]        # that prompt's ids and every generated token: what the agent's cache holds
    reply: Reply                # what the client was told
    closed: bool                # the generated tokens end with an end-of-turn token

    def to_json(self) -> dict:
        return {"prompt_text": self.prompt_text, "ids": list(self.ids), "text": self.reply.text,
                "calls": [list(c) for c in self.reply.calls], "closed": self.closed}

    @classmethod
    def from_json(cls, doc: dict) -> "Said":
        """Raises: KeyError, TypeError, ValueError for a document :meth:`to_json` did not write."""
        reply = Reply(str(doc["text"]), tuple((str(n), str(a)) for n, a in doc["calls"]))
        return cls(str(doc["prompt_text"]), tuple(int(i) for i in doc["ids"]), reply, bool(doc["closed"]))


# turns remembered per agent: the last, and a few before it (a regenerate, a branch)
TURNS = 4


class EchoBook:
    """Each named agent's last :data:`TURNS` turns (at most ``limit`` agents, least recently used go
    first); thread-safe."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._said: OrderedDict[str, tuple[Said, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.spliced = 0   # prompts built from the generated ids
        self.rendered = 0  # prompts of agents this book knew, rendered because the echo did not match

    def remember(self, agent_id: str, said: Said) -> None:
        with self._lock:
            older = tuple(s for s in self._said.get(agent_id, ()) if s != said)
            self._said[agent_id] = (said, *older)[:TURNS]
            self._said.move_to_end(agent_id)
            while len(self._said) > self.limit:
                self._said.popitem(last=False)

    def said(self, agent_id: str) -> Said | None:
        """The agent's last turn."""
        with self._lock:
            turns = self._said.get(agent_id)
        return turns[0] if turns else None

    def splice(self, agent_id: str, messages: Sequence[dict], render: Callable[[Sequence[dict], bool], str],
               encode: Callable[[str], list[int]], end_texts: Sequence[str]) -> tuple[tuple[int, ...], str] | None:
        """The prompt ids (and the prompt's template text) of ``messages`` with the agent's last reply
        as generated, or None when the messages do not echo it (see the module doc)."""
        with self._lock:
            turns = self._said.get(agent_id, ())
        if not turns:
            return None
        out = next((o for o in (self._splice(s, messages, render, encode, end_texts) for s in turns)
                    if o is not None), None)
        with self._lock:
            self.spliced += out is not None
            self.rendered += out is None
        return out

    @staticmethod
    def _splice(said: Said, messages, render, encode, end_texts):
        k = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if k is None or k == len(messages) - 1 or Reply.of(messages[k]) != said.reply:
            return None
        if render(messages[:k], True) != said.prompt_text:
            return None  # the history before the reply was edited
        before = render(messages[:k], False)
        upto, full = render(messages[: k + 1], False), render(messages, True)
        if not (said.prompt_text.startswith(before) and full.startswith(upto) and upto.startswith(before)):
            return None  # a template that renders a prefix differently once more follows
        # the template's own form of the reply, from its turn's header on: it may differ from the
        # generation prompt (a thinking template opens <think> there, and drops old reasoning here)
        segment = upto[len(before):]
        ends = [(segment.rfind(e), e) for e in end_texts]
        at, end = max(ends, default=(-1, ""))
        if at == -1:
            return None
        after = segment[at + len(end):] if said.closed else segment[at:]  # the generated ids hold the end token
        return said.ids + tuple(encode(after + full[len(upto):])), full
