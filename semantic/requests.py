"""What a request may be: agent ids, prompts, token budgets. Shared by the engine and the scheduler.

Every check here raises before any state changes, with a message that says
what to send instead.
"""

from __future__ import annotations

import unicodedata
from typing import Sequence

from semantic.errors import InvalidAgentIdError, InvalidRequestError

MAX_AGENT_ID = 256


def validate_agent_id(agent_id) -> None:
    """Accept the agent ids the cache store can keep (see ``store.file_name``).

    Raises:
        InvalidAgentIdError: not a string of 1 to 256 characters, or it
            contains control characters (NUL included) or lone surrogates.
    """
    if not isinstance(agent_id, str) or not 1 <= len(agent_id) <= MAX_AGENT_ID:
        shown = agent_id if not isinstance(agent_id, str) else f"{len(agent_id)} characters"
        raise InvalidAgentIdError(f"agent id must be a string of 1 to {MAX_AGENT_ID} characters, got {shown!r}")
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in agent_id):
        raise InvalidAgentIdError(f"agent id {agent_id!r} contains control characters or lone surrogates")


def check_max_tokens(max_tokens) -> None:
    """Raise :class:`InvalidRequestError` unless ``max_tokens`` is a positive integer (not a bool)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")


def render_chat(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the reply.

    Raises:
        InvalidRequestError: not a non-empty list of ``{"role", "content"}``
            string dicts, or the tokenizer has no chat template.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidRequestError(f"each message needs string 'role' and 'content', got {m!r}"[:200])
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this tokenizer has no chat template: submit token ids or text")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return [int(t) for t in ids]


def prompt_ids(tokenizer, prompt, *, continuing: bool = False, messages: bool = False) -> list[int]:
    """Token ids of ``prompt``: text (tokenized), token ids, or with ``messages``
    chat messages (:func:`render_chat`).

    ``continuing`` text follows a cached history, so it gets no second BOS in
    the middle of it.

    Raises:
        InvalidRequestError: the prompt is none of these.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=not continuing))
    if messages and isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return render_chat(tokenizer, prompt)
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        what = "messages, text or token ids" if messages else "text or a sequence of token ids"
        raise InvalidRequestError(f"prompt must be {what}") from None
