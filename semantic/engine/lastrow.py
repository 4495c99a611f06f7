"""The logits of a prompt chunk's last position only: its head computes one row, not one per token.

mlx-lm's models run a body (``model.model``: the layers and the final norm), then a head on every
position: ``lm_head``, or the tied embedding, and Gemma's soft-capping. A chunk of ``n`` tokens'
logits cost ``n × hidden × vocabulary``: Gemma 3 270M's 262,144-token vocabulary makes a
250-token chunk's logits dearer than all its layers (f32, OpenBLAS, 2 cores: 4.5 s with them, 2.5 s without).
mlx-lm's own prefill feeds the last token alone, one more forward pass. Here the model's own call
runs once, with the body's output cut to the last position, so the head sees one row::

    tokens   [t0 ........................ tn]
    body     [h0 ........................ hn]   every layer, every position (the cache needs them)
    head                                 [hn]   -> logits (1, 1, vocabulary)

The cut replaces the body for one call, in the calling thread (the engine's: it alone calls its
model). A model whose body is not ``model.model`` (or ``model.language_model.model``) gets every
row, as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


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
    cache is updated for every token."""
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
