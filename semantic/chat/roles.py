"""A conversation in the shape the model's chat template accepts: system turns and runs of user turns.

Clients put system (OpenAI: developer) messages inside the conversation:
Claude Code sends its environment block as ``messages[1]``, after the first
user turn. A template that renders a system turn where it stands (ChatML's)
gets the messages as they are. One that enforces user/assistant alternation
(Gemma's, Mistral's) gets them moved, the same way on every turn, so that
each request's prefix is the previous request's::

    s0  u1  [s1]  a1  u2  [s2]  u3  a2  u4    the client's messages
    s0+s1   u1    a1  ─ u2+s2+u3 ─  a2  u4    what a strict template gets
      system turns before the first    one after a reply is user text where it
      reply join the system prompt     stands, joined with the user turns beside
      (the first request has them)     it: the turns before keep their tokens

Consecutive user turns (a tool result rendered as user text, then the
user's own text, as Claude Code sends them) become one. Every change stays
between two replies, so a turn's rendering never changes once a reply follows it.
"""

from __future__ import annotations

from typing import Callable, Sequence

_MARK = "\u2063mid-system\u2063"  # a text no template writes on its own
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "system", "content": _MARK},
          {"role": "user", "content": "v"}]


def renders_mid_system(render: Callable[[list[dict]], str]) -> bool:
    """Whether the template renders a system turn after a reply, where it stands (``render``: messages to text)."""
    try:
        return _MARK in render(list(_PROBE))
    except Exception:  # the template's own refusal (a jinja raise_exception): it does not
        return False


def fit(messages: Sequence[dict], free: bool) -> list[dict]:
    """``messages`` for a template that renders system turns anywhere (``free``: as they are) or not
    (moved as the module doc draws, and consecutive user turns joined)."""
    if free or not all(_well_formed(m) for m in messages):
        return list(messages)  # malformed ones are render_text's to refuse, by name
    first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    system = [m["content"] for m in messages[:first_reply] if m["role"] == "system"]
    out: list[dict] = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            if i < first_reply:
                continue
            m = {"role": "user", "content": m["content"]}  # between two replies: user text, where it stands
        if m["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            continue
        out.append(m)
    return out


def _well_formed(m) -> bool:
    return (isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or m["role"] == "assistant"))
