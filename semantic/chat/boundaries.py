"""Where a chat prompt's messages end, in its token ids: the positions a later turn may start over from.

A model that resumes only from a snapshot (``semantic.cache.snapshots``) needs its
prefill to stop where the next request will diverge. Two places matter in
agent traffic::

    ids        [ system + tools | user | assistant | ... | last message | gen prompt ]
                                ^ a second agent with the same system prompt
                                                          ^ an edit of the last message, a new one after a branch

A cut counts only when it is exact: the template's text of the messages
before it is a prefix of the whole text, and the rest of the text tokenizes
to exactly the ids after it (or the prefix to the ids before it). Otherwise
it is left out, never guessed.
"""

from __future__ import annotations

from typing import Callable, Sequence

SYSTEM_ROLES = ("system", "developer")


def message_boundaries(
    ids: Sequence[int], messages: Sequence[dict], text: str,
    render: Callable[[Sequence[dict]], str], tokens: Callable[[str], list[int]],
) -> tuple[int, ...]:
    """The positions in ``ids`` (the tokens of ``text``, the whole prompt; an echoed reply may
    stand as its generated ids) where the leading system messages end and where the last
    message starts. ``render(msgs)`` is the template's text of ``msgs`` without a generation
    prompt; ``tokens`` tokenizes text as the prompt was."""
    n = len(messages)
    system = 0
    while system < n and messages[system].get("role") in SYSTEM_ROLES:
        system += 1
    cuts = {c for c in (system, n - 1) if 0 < c < n}
    out = set()
    for c in cuts:
        prefix = render(messages[:c])
        if not prefix or not text.startswith(prefix):
            continue
        head = tokens(prefix)
        if 0 < len(head) < len(ids) and tuple(ids[: len(head)]) == tuple(head):
            out.add(len(head))
            continue
        tail = tokens(text[len(prefix):])
        if 0 < len(tail) < len(ids) and tuple(ids[-len(tail):]) == tuple(tail):
            out.add(len(ids) - len(tail))
    return tuple(sorted(out))
