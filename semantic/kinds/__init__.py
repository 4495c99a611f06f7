"""One class per kind of layer cache: each says, in one place, what it holds after ``T`` tokens,
how its mlx-lm cache is made, read into pooled storage, rebuilt, batched, where a prefix can
resume from it, and what it costs::

    kind       mlx-lm cache                          holds after T tokens                    resumes
    global     KVCache, QuantizedKVCache (MLA too)   [0, T)                                  anywhere
    sliding    RotatingKVCache(window, keep)         [0, keep) + the last window - keep      anywhere, or at snapshots
    chunked    ChunkedKVCache(chunk)                 the last min(T, chunk)                  anywhere, or at snapshots
    recurrent  ArraysCache(n) (0.30.4: MambaCache)   n fixed arrays that summarise [0, T)    at snapshots only

A window shorter than a block resumes only at snapshots (``LayerSpec.snapshot_only``).
Two shapes of model cache list have no kind of their own: a ``CacheList`` (several caches
in one layer) is flattened into its leaves (``ModelCacheSpec.nesting``), and layers that
own no cache (Gemma 3n/4's KV-shared layers, Nemotron-H's MLP layers) have no entry at all.
"""

from __future__ import annotations

from typing import Sequence

from semantic.kinds.attention import Attention
from semantic.kinds.base import Kind
from semantic.kinds.chunked import Chunked
from semantic.kinds.recurrent import Recurrent
from semantic.kinds.sliding import Sliding

GLOBAL, SLIDING, CHUNKED, RECURRENT = "global", "sliding", "chunked", "recurrent"
KINDS: dict[str, Kind] = {GLOBAL: Attention(), SLIDING: Sliding(), CHUNKED: Chunked(), RECURRENT: Recurrent()}
_BY_CLASS = {cls: k for k in KINDS.values() for cls in k.cache_classes}


def of(layer) -> Kind:
    """The kind of a ``LayerSpec``."""
    return KINDS[layer.kind]


def for_cache(cache) -> Kind | None:
    """The kind of a live mlx-lm cache object, or None when no kind holds it."""
    for cls in type(cache).__mro__:
        if cls.__name__ in _BY_CLASS:
            return _BY_CLASS[cls.__name__]
    return None


def merge(per_sequence: Sequence[list], rows: bool = False) -> list:
    """Per-layer batch caches from each sequence's single caches (one row each, left-padded; with ``rows``,
    global attention's rows each in its own buffers: ``kinds.rows``); a ``CacheList``'s children are
    batched each as a layer of their own."""
    from mlx_lm.models import cache as C

    from semantic.errors import UnsupportedCacheError

    merged = []
    for layer in zip(*per_sequence):
        if isinstance(layer[0], C.CacheList):
            merged.append(C.CacheList(*merge([c.caches for c in layer], rows)))
            continue
        kind = for_cache(layer[0])
        if kind is None:
            raise UnsupportedCacheError(f"cannot batch a {type(layer[0]).__name__}")
        merged.append(kind.batch(list(layer), rows))
    return merged


__all__ = ["CHUNKED", "GLOBAL", "KINDS", "RECURRENT", "SLIDING", "Kind", "for_cache", "merge", "of"]
