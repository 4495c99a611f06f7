"""Chunked attention (llama4): ``ChunkedKVCache(chunk)``. A query attends only to the keys of its
own absolute chunk ``[p // chunk * chunk, p]``; the cache keeps at most the newest ``chunk``
positions (trimmed at the front at each model call), so what a later token needs after ``T``
tokens is the newest ``min(T, chunk)``::

    chunk 8, T = 19    held [11 ........ 19)    needed by the next token: [16, 19)

It is kept like a sliding window of ``chunk`` (the extra, masked positions cost nothing but
bytes). mlx-lm has no batched form: a model with these layers decodes one sequence at a time."""

from __future__ import annotations

from mlx_lm.models import cache as C

from semantic import compat
from semantic.errors import CacheMismatchError, UnsupportedCacheError
from semantic.kinds.base import Positional


class Chunked(Positional):
    name = "chunked"
    cache_classes = (compat.CHUNKED,)
    windowed = True
    rewinds = False
    batches = False
    no_speculation = ("chunked layers decode one sequence at a time on mlx-lm's single ChunkedKVCache (it has no "
                      "batch form), and rejected drafts leave batch caches only")

    def check(self, layer) -> None:
        if not compat.CHUNKED_TRIMS_TOKENS:
            raise UnsupportedCacheError(f"this mlx-lm's {compat.CHUNKED} trims by its buffer size, not its tokens, "
                                        f"and breaks on a chunked prefill: upgrade mlx-lm (0.32 has the fix)")
        super().check(layer)
        if not layer.window or layer.window <= 0 or layer.keep or layer.kv_bits is not None:
            raise ValueError("a chunked layer needs a positive chunk (window), no keep and no quantization")

    def held_ranges(self, layer, total):
        return [(max(0, total - layer.window), total)] if total else []

    def snapshot_only(self, layer, block_tokens):
        return layer.window < block_tokens

    def group(self, layer):
        return f"chunked-w{layer.window}"

    def make(self, layer):
        return C.ChunkedKVCache(layer.window)

    def spec_fields(self, cache, kv_bits, kv_group_size):
        st = compat.read_layer(cache)
        return dict(kind=self.name, window=st.max_size, **self.common_fields(st))

    def read(self, i, layer, cache, total):
        st = compat.read_layer(cache)
        if st.kind != compat.CHUNKED or st.max_size != layer.window:
            raise CacheMismatchError(f"layer {i} is a {st.kind}/{st.max_size}; the spec says chunk {layer.window}")
        n = self.tokens(layer, total)
        keys, values = st.keys[..., st.keys.shape[2] - n :, :], st.values[..., st.values.shape[2] - n :, :]
        return self.checked(i, layer, compat.LayerState(compat.CHUNKED, keys, values, st.offset, max_size=layer.window,
                                                        idx=st.offset - n), total)

    def buffered(self, i, layer, cache, total):
        st = compat.read_layer(cache)  # [start_position, offset): trimmed only before the next call
        if st.kind != compat.CHUNKED or st.max_size != layer.window or st.offset != total:
            raise CacheMismatchError(f"layer {i} is a {st.kind}/{st.max_size} of {st.offset} tokens; "
                                     f"the spec says chunk {layer.window}, {total} tokens")
        return st

    def build(self, i, layer, first, second, total, held):
        self.check_kv(i, layer, first, held, "keys")
        self.check_kv(i, layer, second, held, "values")
        return compat.build_layer(compat.LayerState(compat.CHUNKED, first, second, total, max_size=layer.window,
                                                    idx=total - held))

    def batch(self, caches, rows=False):
        raise AssertionError("a model with chunked layers decodes one sequence at a time (batches = False)")
