"""Global attention: ``KVCache`` (any head and value dims: MLA's latent caches are one head of
the latent width beside the rope keys), or ``QuantizedKVCache`` with ``kv_bits``. Holds every
position, so any prefix of it serves."""

from __future__ import annotations

from mlx_lm.models import cache as C

from semantic import compat
from semantic.errors import CacheMismatchError, CacheShapeError
from semantic.kinds.base import DTYPES, Positional
from semantic.kinds.batchone import BatchOneKVCache
from semantic.kinds.rows import RowsKVCache


class Attention(Positional):
    name = "global"
    cache_classes = (compat.KV, compat.QUANTIZED)

    def check(self, layer) -> None:
        super().check(layer)
        if layer.window is not None or layer.keep:
            raise ValueError("a global layer has no window or keep")
        if (layer.kv_bits is None) != (layer.kv_group_size is None):
            raise ValueError("kv_bits and kv_group_size go together")
        if layer.kv_bits is not None:
            if layer.kv_bits not in (2, 3, 4, 5, 6, 8) or layer.kv_group_size not in (32, 64, 128):
                raise ValueError(f"unsupported KV quantization {layer.kv_bits} bits / group {layer.kv_group_size}")
            if layer.head_dim % layer.kv_group_size or layer.v_head_dim % layer.kv_group_size:
                raise ValueError(f"head_dim {layer.head_dim} is not a multiple of group {layer.kv_group_size}")

    def cache_class(self, layer) -> str:
        return compat.QUANTIZED if layer.kv_bits else compat.KV

    def held_ranges(self, layer, total: int) -> list[tuple[int, int]]:
        return [(0, total)] if total else []

    def group(self, layer) -> str:
        return f"global-q{layer.kv_bits}g{layer.kv_group_size}" if layer.kv_bits else "global"

    def token_bytes(self, layer) -> float:
        """K plus V per token (quantized: packed + scales + biases)."""
        if not layer.kv_bits:
            return super().token_bytes(layer)
        width = DTYPES[layer.dtype].size
        per = lambda d: d * layer.kv_bits / 8 + 2 * (d // layer.kv_group_size) * width  # noqa: E731
        return layer.n_kv_heads * (per(layer.head_dim) + per(layer.v_head_dim))

    def make(self, layer):
        if layer.kv_bits:
            return C.QuantizedKVCache(group_size=layer.kv_group_size, bits=layer.kv_bits)
        return C.KVCache()

    def spec_fields(self, cache, kv_bits, kv_group_size) -> dict:
        st = compat.read_layer(cache)
        q = dict(kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else {}
        return dict(kind=self.name, **self.common_fields(st), **q)

    def spare(self, cache):
        if cache.keys is None:
            return 0
        keys = cache.keys[0] if isinstance(cache.keys, tuple) else cache.keys
        return keys.shape[2] - cache.offset  # mlx-lm grows it in steps of 256 slots

    def buffers(self, layer, cache):
        if not self.takes_room(layer) or type(cache) is not C.KVCache or cache.keys is None:
            return None
        return cache.keys, cache.values

    def read(self, i, layer, cache, total):
        st = compat.read_layer(cache)
        if st.kind != self.cache_class(layer):
            raise CacheMismatchError(f"layer {i} is a {st.kind}; the spec says {self.cache_class(layer)}")
        return self.checked(i, layer, st, total)

    def check_kv(self, i, layer, x, n, what) -> None:
        if not layer.kv_bits:
            return super().check_kv(i, layer, x, n, what)
        dim = layer.head_dim if what == "keys" else layer.v_head_dim
        if not (isinstance(x, tuple) and len(x) == 3):
            raise CacheShapeError(f"layer {i} {what}: a quantized layer needs (packed, scales, biases)")
        side = (1, layer.n_kv_heads, n, dim // layer.kv_group_size)
        want = [(1, layer.n_kv_heads, n, dim * layer.kv_bits // 32), side, side]
        shapes = [tuple(p.shape) for p in x]
        if shapes != want or x[1].dtype != DTYPES[layer.dtype]:
            raise CacheShapeError(f"layer {i} {what}: shapes {shapes} / {x[1].dtype}, spec needs {want} / {layer.dtype}")

    def build(self, i, layer, first, second, total, held):
        self.check_kv(i, layer, first, held, "keys")
        self.check_kv(i, layer, second, held, "values")
        kind = self.cache_class(layer)
        return compat.build_layer(compat.LayerState(kind, first, second, total, group_size=layer.kv_group_size,
                                                    bits=layer.kv_bits))

    def keeps_rows(self, layer) -> bool:
        return not layer.kv_bits  # a quantized cache's rows merge (batchquant)

    def takes_room(self, layer) -> bool:
        # mlx-lm's KVCache writes into spare slots in place and grows by a copy of the whole cache; a
        # quantized one keeps its own triples
        return not layer.kv_bits

    def build_with_room(self, i, layer, first, second, total, held, room, kept=None):
        assert self.takes_room(layer) and total == held, (layer, total, held)
        if kept is not None and kept.keys is first and kept.values is second:
            # the same arrays have the shapes checked when it was made; only where the turn starts moves
            kept.offset = total
            return kept
        # the shapes, as check_kv's, without a view of each buffer made to ask (a resumed turn's whole cost),
        # in one comparison: a small resumed turn's rebuild is mostly this, once per layer
        n, dt = held + room, DTYPES[layer.dtype]
        if (first.shape != (1, layer.n_kv_heads, n, layer.head_dim) or first.dtype != dt
                or second.shape != (1, layer.n_kv_heads, n, layer.v_head_dim) or second.dtype != dt):
            for x, dim, what in ((first, layer.head_dim, "keys"), (second, layer.v_head_dim, "values")):
                if tuple(x.shape) != (1, layer.n_kv_heads, n, dim) or x.dtype != dt:
                    raise CacheShapeError(f"layer {i} {what}: got {(tuple(x.shape), x.dtype)}, spec needs "
                                          f"{(1, layer.n_kv_heads, held, dim)} {layer.dtype} and {room} spare slots")
        cache = C.KVCache()
        cache.keys, cache.values, cache.offset = first, second, total
        return cache

    def batch(self, caches, rows=False):
        if isinstance(caches[0], C.QuantizedKVCache):
            from semantic.kinds.batchquant import BatchQuantizedKVCache  # mlx-lm has none

            return BatchQuantizedKVCache.merge(caches)
        if rows and all(type(c) is C.KVCache for c in caches):  # every row in its own buffers, alone or not
            return RowsKVCache.merge(caches)
        if len(caches) == 1 and type(caches[0]) is C.KVCache:  # alone: decodes in its own buffers
            return BatchOneKVCache.wrap(caches[0])
        return C.BatchKVCache.merge(caches)
