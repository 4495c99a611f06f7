"""A batch of global-attention rows that stay in their own K/V buffers: no merge copy, attention row by row.

mlx-lm's ``BatchKVCache`` keeps every row in one left-padded tensor. A row joining copies the rows into it
(``merge``: zeros, then a copy of each; ``extend``: both batches concatenated), a row leaving is copied out
(``extract``) and the rest copied again (``filter``), and while they decode together each row's history is
held twice, in the pool and in the batch. Here each row stays the batch of one it would be alone
(``BatchOneKVCache``: the pool's buffers, their spare slots, widened in the pool when outgrown) and the
batch is the list of them::

    RowsKVCache   [ BatchOne(row 0's buffers) | BatchOne(row 1's buffers) | .. ]    offset [n0, n1, ..]
    update_and_fetch(keys (B, H, L, D))  -> each row writes its L keys in place -> RowKV: one view a row
    attention(queries (B, Hq, L, D))     -> one attention a row over its own keys -> (B, Hq, L, Dv)

A batch keeps its rows apart once one of them holds :data:`APART_FROM_BYTES` of cache (the step loop
decides as rows join; a merged batch a long row joins is made again, kept apart, from its short rows'
copies); below that, the copy is cheap and one attention for all rows is faster. Joining, leaving and
taking a row out are list operations; a row's rejected draft tokens leave by moving
its own end back (:meth:`RowsKVCache.rewind`). Only the attention reads K/V per row; every other op of a
layer stays batched. The process's ``mx.fast.scaled_dot_product_attention`` (``semantic.cpuattention``)
attends a :class:`RowKV` row by row. Most mlx-lm model types hand the keys ``update_and_fetch`` returns
straight to it; one that computes with them first fails on a ``RowKV`` (or drifts), which the batch probe
finds at load (``batchprobe.rows_problem``), and that model's batches merge as before.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import cache as C

from semantic.kinds.batchone import BatchOneKVCache

# a batch keeps its rows apart once one of them holds this much cache: below it a row's merge copy is cheap,
# and attending row by row costs each decode step one attention a row (SmolLM2, 4 rows of 300-640 tokens:
# a step 94 ms against 90 merged; EXP-022's batch of short prompts decoded 1.14x slower kept apart)
APART_FROM_BYTES = 32 << 20


class RowKV:
    """Each row's keys (or values), ``(1, heads, n_row, dim)``: what a row-wise batch hands the attention.
    No shape, no arithmetic: a model that computes with a layer's keys fails here, at once."""

    __slots__ = ("rows",)

    def __init__(self, rows: Sequence[mx.array]):
        self.rows = tuple(rows)


def attend(queries: mx.array, keys: RowKV, values: RowKV, sdpa, *, scale: float, mask=None, sinks=None,
           **kwargs) -> mx.array:
    """``sdpa`` (an ``mx.fast.scaled_dot_product_attention``) of each row's queries over its own keys."""
    assert queries.shape[0] == len(keys.rows) == len(values.rows), (queries.shape, len(keys.rows))
    assert mask is None or mask == "causal", "a row-wise batch makes no array mask (RowsKVCache.make_mask)"
    if len(keys.rows) == 1:
        return sdpa(queries, keys.rows[0], values.rows[0], scale=scale, mask=mask, sinks=sinks, **kwargs)
    outs = [sdpa(queries[b: b + 1], k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
            for b, (k, v) in enumerate(zip(keys.rows, values.rows))]
    return mx.concatenate(outs, axis=0)


class RowsKVCache(C._BaseCache):
    """A batch of ``KVCache`` rows, each kept over its own buffers (module doc)."""

    def __init__(self, rows: Sequence[BatchOneKVCache]):
        self.rows = list(rows)
        self.offset = self._offsets()

    @classmethod
    def merge(cls, caches: Sequence[C.KVCache]) -> "RowsKVCache":
        """A batch of the sequences ``caches`` hold, over their own buffers (nothing is copied)."""
        assert all(type(c) is C.KVCache for c in caches), [type(c).__name__ for c in caches]
        return cls([BatchOneKVCache.wrap(c) for c in caches])

    def _offsets(self) -> mx.array:
        return mx.array([r._idx for r in self.rows]) if self.rows else mx.array([], mx.int32)

    @property
    def left_padding(self) -> mx.array:
        return mx.zeros((len(self.rows),), mx.int32)  # no row is padded

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[RowKV, RowKV]:
        assert keys.shape[0] == len(self.rows), (keys.shape, len(self.rows))
        if len(self.rows) == 1:  # a lone row: no slice of the step's keys to make
            fetched = [self.rows[0].update_and_fetch(keys, values)]
        else:
            fetched = [r.update_and_fetch(keys[b: b + 1], values[b: b + 1]) for b, r in enumerate(self.rows)]
        self.offset = self.offset + keys.shape[2]
        return RowKV([k for k, _ in fetched]), RowKV([v for _, v in fetched])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        """No mask for one new token a row; several attend causally to their own row, ending at its last key.
        A window or an array mask (one array for rows of different lengths) is not made here: the model's
        code that asks for one fails, and its batches merge (``batchprobe.rows_problem``)."""
        if return_array or window_size is not None:
            raise NotImplementedError("a row-wise batch has no one mask array for rows of different lengths")
        return None if N == 1 else "causal"

    def extend(self, other: "RowsKVCache") -> None:
        assert isinstance(other, RowsKVCache), type(other).__name__
        self.rows += other.rows
        self.offset = self._offsets()

    def filter(self, batch_indices) -> None:
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        self.rows = [self.rows[i] for i in keep]
        self.offset = self._offsets()

    def extract(self, idx: int) -> C.KVCache:
        """Row ``idx`` as a ``KVCache`` over its own buffers (``BatchOneKVCache.extract``)."""
        return self.rows[idx].extract(0)

    def rewind(self, drop: Sequence[int]) -> None:
        """Take the newest ``drop[i]`` tokens of row ``i`` back out: its end moves back (the slots past it are
        written again by the next update)."""
        assert len(drop) == len(self.rows), (drop, len(self.rows))
        for r, d in zip(self.rows, drop):
            if d:
                assert r._idx >= d, (r._idx, d)
                r._idx -= d
                r.offset = r.offset - d
        self.offset = self._offsets()

    @property
    def keys(self) -> list | None:
        """Each row's keys buffer (what ``compat.cache_arrays`` evaluates), None before any row has one."""
        return [r.keys for r in self.rows if r.keys is not None] or None

    @property
    def values(self) -> list | None:
        return [r.values for r in self.rows if r.values is not None] or None

    def size(self) -> int:
        return max((r._idx for r in self.rows), default=0)

    def empty(self) -> bool:
        return not self.rows or all(r.keys is None for r in self.rows)

    @property
    def state(self):
        return [r.state for r in self.rows]

    @property
    def nbytes(self) -> int:
        return sum(r.keys.nbytes + r.values.nbytes for r in self.rows if r.keys is not None)
