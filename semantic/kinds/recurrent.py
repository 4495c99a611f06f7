"""Recurrent state: ``ArraysCache(n)`` (0.30.4: ``MambaCache`` for two arrays). Its ``n`` arrays
(convolution windows, SSM or delta-rule states) summarise every token so far and have no token
axis, so nothing can be cut from them: a prefix resumes only at a position where they were
copied (a snapshot). A snapshot block holds ``(arrays, ())``; each array is copied on the way
in and handed out as a new object on the way back, so a cache that writes into its arrays never
reaches a stored snapshot (vllm-mlx #575). Batched by stacking rows (one token per row when
decoding: no padding, no mask). A rejected speculative draft cannot be taken back out of a state,
so a speculative step keeps the arrays from before it and limits each row to its real inputs
(mlx-lm's right padding, ``lengths``); a row that accepted less than its whole draft is put back
and fed its accepted tokens again (``semantic.decode.replay``)."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models import cache as C

from semantic import compat
from semantic.errors import CacheMismatchError, CacheShapeError, UnsupportedCacheError
from semantic.kinds.base import DTYPES, Kind, dtype_name


class Recurrent(Kind):
    name = "recurrent"
    cache_classes = (compat.ARRAYS,)
    rewinds = False
    replays = True

    def check(self, layer) -> None:
        try:
            arrays = tuple((tuple(int(d) for d in shape), str(dtype)) for shape, dtype in layer.arrays)
        except (TypeError, ValueError):
            raise ValueError(f"a recurrent layer's arrays are (shape, dtype) pairs, got {layer.arrays!r}") from None
        object.__setattr__(layer, "arrays", arrays)
        if layer.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {layer.dtype!r}")
        if not arrays or any(min(shape, default=1) <= 0 or dt not in DTYPES for shape, dt in arrays):
            raise ValueError(f"a recurrent layer needs arrays of positive shape and known dtype, got {arrays}")
        if layer.window is not None or layer.keep or layer.kv_bits is not None or layer.kv_group_size is not None:
            raise ValueError("a recurrent layer has no window, keep or KV quantization")

    def held_ranges(self, layer, total):
        return [(total - 1, total)] if total else []  # the state stands at the last position

    def snapshot_only(self, layer, block_tokens):
        return True

    def state_bytes(self, layer) -> int:
        return sum(math.prod(shape) * DTYPES[dt].size for shape, dt in layer.arrays)

    def make(self, layer):
        return compat.new_arrays(len(layer.arrays))

    def spec_fields(self, cache, kv_bits, kv_group_size):
        arrays = compat.read_arrays(cache)
        odd = [str(a.dtype) for a in arrays if a.dtype not in DTYPES.values()]
        if odd:  # longcat_flash_ngram keeps its token history here: it grows, it is no fixed-size state
            raise UnsupportedCacheError(f"an {compat.ARRAYS} holds {', '.join(odd)} arrays (token ids, not a "
                                        f"recurrent state of fixed size): no snapshot of it can be stored exactly")
        dims = tuple((tuple(a.shape[1:]), dtype_name(a.dtype)) for a in arrays)
        return dict(kind=self.name, n_kv_heads=0, head_dim=0, v_head_dim=0, dtype=dtype_name(arrays[0].dtype),
                    arrays=dims)

    def check_arrays(self, i: int, layer, arrays) -> None:
        got = [(tuple(a.shape), a.dtype) for a in arrays] if isinstance(arrays, tuple) else arrays
        want = [((1, *shape), DTYPES[dt]) for shape, dt in layer.arrays]
        if got != want:
            raise CacheShapeError(f"layer {i} state: got {got}, spec needs {want}")

    def read(self, i, layer, cache, total):
        if not compat.is_arrays(cache):
            raise CacheMismatchError(f"layer {i} is a {type(cache).__name__}; the spec says {compat.ARRAYS}")
        if not total:
            return ()
        arrays = compat.read_arrays(cache)  # copies
        self.check_arrays(i, layer, arrays)
        return arrays

    def snapshot(self, held) -> tuple:
        return held, ()

    def build(self, i, layer, first, second, total, held):
        self.check_arrays(i, layer, first)
        return compat.build_arrays(first)

    def batch(self, caches, rows=False):
        batch = C.ArraysCache.merge(caches)
        return compat.build_arrays(batch.cache) if len(batch.cache) == 2 else batch  # 0.30.4: a MambaCache

    def keep(self, cache):
        return compat.live_arrays(cache)  # references: a pass assigns new arrays, it never writes into these

    def limit(self, cache, lengths):
        compat.limit_rows(cache, lengths)

    def put_back(self, cache, kept, rows):
        back = mx.array(list(rows))
        now = compat.live_arrays(cache)
        compat.set_live_arrays(cache, [mx.where(back.reshape(-1, *(1,) * (a.ndim - 1)), k, a)
                                       for k, a in zip(kept, now)])
