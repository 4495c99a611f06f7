"""How many tokens a turn may generate: what was asked, cut to what the context and the pool leave."""

from __future__ import annotations

from semantic import defaults
from semantic.errors import ContextLengthError


def fit_max_tokens(prompt_tokens: int, requested: int | None, *, context_length: int, pool_tokens: int | None = None,
                  strict: bool = False, default: int | None = defaults.MAX_TOKENS) -> int:
    """A turn's ``max_tokens``: what was ``requested``, cut to what the context (and the pool) leave after
    the prompt; none requested: ``default``, cut the same way (None: all the context leaves, as an API
    whose budget is open-ended by definition wants).

    A prompt that leaves no room for one token is a ContextLengthError; so is
    a ``requested`` budget that does not fit when ``strict`` (the hosted APIs'
    behaviour). ``pool_tokens`` is the longest cache the block pool can hold
    (None: no bound).
    """
    limits = [(context_length, _context_message)] + ([(pool_tokens, _pool_message)] if pool_tokens is not None else [])
    need = 1 if requested is None or not strict else requested
    for limit, message in limits:
        if prompt_tokens + need > limit:
            raise ContextLengthError(message(limit, prompt_tokens, need))
    left = min(limit - prompt_tokens for limit, _ in limits)
    asked = requested if requested is not None else default
    return left if asked is None else min(asked, left)


def _context_message(limit: int, prompt: int, completion: int) -> str:
    return (f"This model's maximum context length is {limit} tokens. However, you requested {prompt + completion} "
            f"tokens ({prompt} in the prompt, {completion} for the completion). Please reduce the length of the "
            f"messages or completion.")


def _pool_message(limit: int, prompt: int, completion: int) -> str:
    return (f"{prompt + completion} tokens do not fit this server's block pool (at most {limit} tokens in one cache): "
            f"shorten the request, or restart the server with a larger --pool-mb")
