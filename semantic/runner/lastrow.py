"""The logits of a prompt's last chunk at its last position only: one forward pass, its head on one row.

mlx-lm's models run a body (``model.model``: the layers and the final norm), then a head on every
position (``lm_head`` or the tied embedding, and Gemma's soft-capping). mlx-lm's own prefill feeds a
prompt's last token alone after a pass whose logits are never read, so the head computes one row; the
price is one more forward pass, which on a CPU reads every weight again (a decode step: ~180 ms for
SmolLM2 f32 here). For a short last chunk (a sub-agent's task, a short user message) that second pass
is most of the turn, so the step loop runs the model's own call once, with the body's output cut to
the last position::

    tokens   [t0 ........................ tn]
    body     [h0 ........................ hn]   every layer, every position (the cache needs them)
    head                                 [hn]   -> logits (1, 1, vocabulary)

Measured (f32, OpenBLAS, 2 cores; a 513-token cache, median of 5): one cut pass over ``n`` tokens
against a cache-only pass and the last token alone, SmolLM2 0.59x at 2 tokens, 0.84x at 35, 0.94x at
256, 1.00x at 512; Gemma 3 270M 0.65x, 0.83x, 0.96x, 1.03x. Past :data:`ONE_PASS_TOKENS` the last
layer's work over every row costs what the extra pass saves, and the step loop feeds the last token
alone, as mlx-lm does.

The cut replaces the body for one call, in the calling thread (the step loop's: it alone calls its
model). A model whose body is not ``model.model`` (or ``model.language_model.model``) gets every
row, cut after.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

ONE_PASS_TOKENS = 256  # the longest last chunk run as one cut pass (module doc)


class _LastPosition:
    """A model's body whose output is cut to its last position; everything else is the body's."""

    def __init__(self, body):
        self._body = body

    def __getattr__(self, name):
        return getattr(self._body, name)

    def __call__(self, *args, **kwargs):
        out = self._body(*args, **kwargs)
        return out[:, -1:, :] if isinstance(out, mx.array) and out.ndim == 3 else out


def _owner(model) -> nn.Module | None:
    """The module whose ``model`` attribute is the body its call runs before the head."""
    for owner in (model, model.get("language_model") if isinstance(model, nn.Module) else None):
        if isinstance(owner, nn.Module) and isinstance(owner.get("model"), nn.Module):
            return owner
    return None


def last_logits(model, tokens: mx.array, cache) -> mx.array:
    """``model(tokens, cache=cache)``'s logits at the last position, shape ``(batch, vocabulary)``; the
    cache takes every token."""
    owner = _owner(model)
    if owner is None:
        return model(tokens, cache=cache)[:, -1, :]
    # an instance attribute is found before the module's children (nn.Module.__getattr__), and leaves them as they are
    owner.__dict__["model"] = _LastPosition(owner["model"])
    try:
        out = model(tokens, cache=cache)
    finally:
        del owner.__dict__["model"]
    return out[:, -1, :]
