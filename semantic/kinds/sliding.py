"""A sliding window: ``RotatingKVCache(window, keep)``. Holds the ``keep`` pinned first positions
and the newest ``window - keep``; it is read unrolled into temporal order
(``compat.temporal_rotating``) and rebuilt that way, with its write index at the end::

    [0, keep)  +  [T - (window - keep), T)          (all of [0, T) while T <= window)

A window of a block or more resumes anywhere its pooled blocks cover (the executor pools, after
each prefill chunk, the blocks the window held at the block boundaries in it: ``cache.snapshots``); a
shorter one only at snapshots."""

from __future__ import annotations

from mlx_lm.models import cache as C

from semantic import compat
from semantic.errors import CacheMismatchError, UnsupportedCacheError
from semantic.kinds.base import Positional


class Sliding(Positional):
    name = "sliding"
    cache_classes = (compat.ROTATING,)
    windowed = True

    def check(self, layer) -> None:
        super().check(layer)
        if not layer.window or layer.window <= 0:
            raise ValueError("a sliding layer needs a positive window")
        if not 0 <= layer.keep < layer.window:
            raise ValueError(f"keep must be in [0, window), got {layer.keep}")
        if layer.kv_bits is not None:
            raise UnsupportedCacheError("mlx-lm cannot quantize a RotatingKVCache (sliding layer)")

    def held_ranges(self, layer, total):
        if total <= layer.window:
            return [(0, total)] if total else []
        keep = [(0, layer.keep)] if layer.keep else []
        return keep + [(total - (layer.window - layer.keep), total)]

    def snapshot_only(self, layer, block_tokens):
        return layer.window - layer.keep < block_tokens

    def group(self, layer):
        return f"sliding-w{layer.window}-k{layer.keep}"

    def make(self, layer):
        return C.RotatingKVCache(max_size=layer.window, keep=layer.keep)

    def spec_fields(self, cache, kv_bits, kv_group_size):
        st = compat.read_layer(cache)
        return dict(kind=self.name, window=st.max_size, keep=st.keep, **self.common_fields(st))

    def read(self, i, layer, cache, total):
        return self.checked(i, layer, compat.temporal_rotating(self._state(i, layer, cache)), total)

    def buffered(self, i, layer, cache, total):
        # a multi-token call leaves up to window - 1 positions before the chunk as well
        st = compat.temporal_rotating(self._state(i, layer, cache), cut=False)
        if st.offset != total:
            raise CacheMismatchError(f"layer {i} holds {st.offset} tokens but {total} token ids were given")
        return st

    def _state(self, i, layer, cache) -> compat.LayerState:
        st = compat.read_layer(cache)
        if st.kind != compat.ROTATING:
            raise CacheMismatchError(f"layer {i} is a {st.kind}; the spec says {compat.ROTATING}")
        if (st.max_size, st.keep) != (layer.window, layer.keep):
            raise CacheMismatchError(f"layer {i} window/keep {st.max_size}/{st.keep} != spec {layer.window}/{layer.keep}")
        return st

    def build(self, i, layer, first, second, total, held):
        self.check_kv(i, layer, first, held, "keys")
        self.check_kv(i, layer, second, held, "values")
        return compat.build_layer(compat.LayerState(compat.ROTATING, first, second, total, layer.keep, layer.window,
                                                    idx=held))

    def batch(self, caches, rows=False):
        # 0.30.4's BatchRotatingKVCache.merge fails on a ring longer than its window, which a
        # multi-token prefill leaves behind: unroll first
        return C.BatchRotatingKVCache.merge([compat.build_layer(compat.temporal_rotating(compat.read_layer(c)))
                                             for c in caches])
