"""What every kind of layer cache answers (see ``semantic.kinds``); positional kinds share :class:`Positional`."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from semantic import compat
from semantic.errors import CacheShapeError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class Kind:
    """A kind of layer cache. ``layer`` is always a ``LayerSpec`` of this kind."""

    name: str = ""
    cache_classes: tuple[str, ...] = ()  # the mlx-lm classes whose objects this kind holds
    windowed = False                     # forgets old tokens
    rewinds = True                       # a batch can take a row's rejected draft tokens back out (rewind.py)
    replays = False                      # ... or be put back to before the step and fed the accepted ones (replay.py)
    batches = True                       # several sequences decode in one batch cache
    no_speculation: str | None = None    # why a model with these layers cannot speculate (None: it can)

    def check(self, layer) -> None:
        """Raise ValueError for fields this kind does not take."""

    def cache_class(self, layer) -> str:
        return self.cache_classes[0]

    def held_ranges(self, layer, total: int) -> list[tuple[int, int]]:
        """Token positions the cache holds after ``total`` tokens."""
        raise NotImplementedError

    def snapshot_only(self, layer, block_tokens: int) -> bool:
        """Whether a prefix resumes only where the whole cache was kept (a snapshot)."""
        return False

    def group(self, layer) -> str:
        """Layers of one group share block boundaries and token coverage."""
        return self.name

    def token_bytes(self, layer) -> float:
        return 0.0

    def state_bytes(self, layer) -> int:
        return 0

    def make(self, layer) -> Any:
        raise NotImplementedError

    def spec_fields(self, cache, kv_bits: int | None, kv_group_size: int) -> dict:
        """The ``LayerSpec`` fields of a live cache of this kind after a one-token probe."""
        raise NotImplementedError

    def spare(self, cache) -> int:
        """Slots the live cache's buffer holds beyond its tokens (0: what :meth:`read` gives is the buffer)."""
        return 0

    def buffers(self, layer, cache) -> tuple | None:
        """The live cache's whole (keys, values) buffers, spare slots included, holding position ``p`` at
        index ``p``, for a kind that :meth:`takes_room`; None for any other."""
        return None

    def read(self, i: int, layer, cache, total: int):
        """A live cache after ``total`` tokens as this kind's held data, checked against ``layer``."""
        raise NotImplementedError

    def buffered(self, i: int, layer, cache, total: int):
        """Everything a live cache after ``total`` tokens holds, in temporal order: its held data, and
        for a window what the last multi-token call left before it (``SnapshotPositions.passed``)."""
        raise NotImplementedError

    def snapshot(self, held) -> tuple:
        """A copy of the held data as a snapshot block's layer data."""
        raise NotImplementedError

    def build(self, i: int, layer, first, second, total: int, held: int) -> Any:
        """The mlx-lm cache after ``total`` tokens from layer data ``(first, second)`` holding ``held``
        tokens in temporal order (a snapshot's, or pieces of blocks joined)."""
        raise NotImplementedError

    def batch(self, caches: list, rows: bool = False) -> Any:
        """One batch cache from single-row caches of this kind; ``rows``: each row kept in its own buffers
        where this kind can (``kinds.rows``), the model's code taking it (``batchprobe.rows_problem``)."""
        raise NotImplementedError

    def keeps_rows(self, layer) -> bool:
        """Whether a batch of this layer's rows keeps each row in its own buffers (``kinds.rows``), where
        the model's code takes that: a row joining or leaving copies nothing, and the batch holds no copy."""
        return False

    def takes_room(self, layer) -> bool:
        """Whether :meth:`build_with_room` gives this layer's cache spare slots for a turn's new tokens."""
        return False

    def build_with_room(self, i: int, layer, first, second, total: int, held: int, room: int, kept=None) -> Any:
        """:meth:`build` over buffers with ``room`` spare slots after the held tokens (``takes_room``). ``kept``:
        the cache an earlier call made over a pool segment's buffers (``Segment.handed``), given again when
        its buffers are still ``(first, second)``."""
        raise NotImplementedError

    # a kind that ``replays`` answers these three (``semantic.decode.replay``)

    def keep(self, cache) -> Any:
        """What a batch cache must keep before a speculative step to be put back to it afterwards."""
        raise NotImplementedError

    def limit(self, cache, lengths) -> None:
        """Let the next forward pass move row ``i`` by its first ``lengths[i]`` inputs only (None: all)."""
        raise NotImplementedError

    def put_back(self, cache, kept, rows) -> None:
        """Rows ``i`` with ``rows[i]`` back to ``kept`` (what :meth:`keep` returned, cut to the batch's rows now)."""
        raise NotImplementedError


class Positional(Kind):
    """K/V per token position (every kind but recurrent): data are ``(keys, values)`` of shape
    ``(1, heads, n, dim)``, or for quantized layers ``(packed, scales, biases)`` tuples."""

    def check(self, layer) -> None:
        if layer.arrays:
            raise ValueError("only a recurrent layer has state arrays")
        # values may be zero-wide (deepseek_v32's indexer cache keeps keys only)
        if min(layer.n_kv_heads, layer.head_dim) <= 0 or layer.v_head_dim < 0:
            raise ValueError(f"heads and head dims must be positive: {layer}")
        if layer.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {layer.dtype!r}")

    def tokens(self, layer, total: int) -> int:
        return sum(b - a for a, b in self.held_ranges(layer, total))

    def token_bytes(self, layer) -> float:
        return layer.n_kv_heads * (layer.head_dim + layer.v_head_dim) * DTYPES[layer.dtype].size

    def common_fields(self, st: compat.LayerState) -> dict:
        _, heads, _, dim = st.keys.shape
        return dict(n_kv_heads=heads, head_dim=dim, v_head_dim=st.values.shape[-1], dtype=dtype_name(st.keys.dtype))

    def check_kv(self, i: int, layer, x, n: int, what: str) -> None:
        """Shape and dtype of K or V holding ``n`` tokens against the spec."""
        dim = layer.head_dim if what == "keys" else layer.v_head_dim
        if isinstance(x, tuple) or tuple(x.shape) != (1, layer.n_kv_heads, n, dim) or x.dtype != DTYPES[layer.dtype]:
            got = [p.shape for p in x] if isinstance(x, tuple) else (tuple(x.shape), x.dtype)
            raise CacheShapeError(f"layer {i} {what}: got {got}, spec needs {(1, layer.n_kv_heads, n, dim)} {layer.dtype}")

    def checked(self, i: int, layer, st: compat.LayerState, total: int) -> compat.LayerState:
        from semantic.errors import CacheMismatchError

        if st.offset != total:
            raise CacheMismatchError(f"layer {i} holds {st.offset} tokens but {total} token ids were given")
        if total:
            n = self.tokens(layer, total)
            self.check_kv(i, layer, st.keys, n, "keys")
            self.check_kv(i, layer, st.values, n, "values")
        return st

    def buffered(self, i: int, layer, cache, total: int) -> compat.LayerState:
        return self.read(i, layer, cache, total)

    def snapshot(self, held: compat.LayerState) -> tuple:
        return copy(held.keys), copy(held.values)


def copy(x):
    """A new array (or tuple of them) with the same data, never the caller's object."""
    return tuple(mx.contiguous(p[...]) for p in x) if isinstance(x, tuple) else mx.contiguous(x[...])


def dtype_name(dt) -> str:
    from semantic.errors import UnsupportedCacheError

    for name, value in DTYPES.items():
        if value == dt:
            return name
    raise UnsupportedCacheError(f"unsupported cache dtype {dt}")
