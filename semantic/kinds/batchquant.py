"""A batched ``QuantizedKVCache``: quantized K/V for several sequences in one forward pass.

mlx-lm batches ``KVCache`` and ``RotatingKVCache`` (``BatchKVCache``,
``BatchRotatingKVCache``) but has no batched quantized cache: it cannot merge
``QuantizedKVCache`` objects (mlx-lm #1583). This is the missing one, written
the way ``BatchKVCache`` is: sequences are right-aligned in one buffer, each
row's ``left_padding`` says how many slots before its first token are empty,
and the mask hides them::

    row 0   [ pad pad | t0 t1 t2 t3 t4 ]     left_padding 2, offset 5
    row 1   [ t0 t1 t2 t3 t4 t5 t6 ]         left_padding 0, offset 7
                                     ^ _idx (the next slot, shared by every row)

Each of K and V is the triple mlx-lm's ``QuantizedKVCache`` holds
``(packed uint32, scales, biases)``, of shape ``(B, heads, slots, ...)``;
empty slots hold zeros. A row extracted from the batch is a plain
``QuantizedKVCache`` with exactly that row's packed values, so batching
changes no stored byte: a row quantizes its new tokens exactly as the solo
cache would (quantization groups run along head_dim, one token at a time).
The model sees ``bits`` and ``group_size`` and runs mlx-lm's quantized
attention with this cache's mask.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as C
from mlx_lm.models.base import create_causal_mask


def _pad_slots(triple, left: int, right: int):
    if not left and not right:
        return triple
    return tuple(mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]) for x in triple)


class BatchQuantizedKVCache(C._BaseCache):
    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys = None
        self.values = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])  # per row: RoPE positions
        self._idx = 0
        self.group_size = group_size
        self.bits = bits

    # ------------------------------------------------------------ the model's side

    def update_and_fetch(self, keys, values):
        B, heads, n, k_dim = keys.shape
        v_dim = values.shape[-1]
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[-2]:
            per_int = 8 * mx.uint32.size // self.bits
            grow = (self.step + n - 1) // self.step * self.step

            def empty(dim):
                shape = (B, heads, grow)
                return (
                    mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                )

            if self.keys is None:
                self.keys, self.values = empty(k_dim), empty(v_dim)
            else:
                cut = lambda x: x[..., :prev, :]  # noqa: E731
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(tree_map(cut, self.keys), empty(k_dim)))
                self.values = tuple(
                    mx.concatenate([a, b], axis=2) for a, b in zip(tree_map(cut, self.values), empty(v_dim))
                )
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self._idx += n
        self.offset = self.offset + n
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, window_size=window_size)

    # ------------------------------------------------------------ batch operations

    @classmethod
    def merge(cls, caches: list) -> "BatchQuantizedKVCache":
        """One batch from single ``QuantizedKVCache`` objects (right-aligned, left-padded)."""
        first = caches[0]
        assert all(c.bits == first.bits and c.group_size == first.group_size for c in caches)
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return batch
        some = next(c for c in caches if c.keys is not None)

        def rows(pick):
            out = []
            for c, n in zip(caches, lengths):
                if c.keys is None:
                    out.append(tuple(mx.zeros((1, *x.shape[1:2], longest, x.shape[-1]), x.dtype) for x in pick(some)))
                else:
                    out.append(_pad_slots(tuple(x[..., :n, :] for x in pick(c)), longest - n, 0))
            return tuple(mx.concatenate([r[i] for r in out], axis=0) for i in range(3))

        batch.keys, batch.values = rows(lambda c: c.keys), rows(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append ``other``'s rows below this batch's, right-aligning both at the longer ``_idx``."""
        idx = max(self._idx, other._idx)

        def aligned(c):
            if c.keys is None:
                return None
            cut = lambda x: x[..., : c._idx, :]  # noqa: E731
            return _pad_slots(tree_map(cut, c.keys), idx - c._idx, 0), _pad_slots(tree_map(cut, c.values), idx - c._idx, 0)

        mine, theirs = aligned(self), aligned(other)
        if mine is None and theirs is not None:
            mine = tuple(tuple(mx.zeros((self.offset.shape[0], *x.shape[1:]), x.dtype) for x in t) for t in theirs)
        if theirs is None and mine is not None:
            theirs = tuple(tuple(mx.zeros((other.offset.shape[0], *x.shape[1:]), x.dtype) for x in t) for t in mine)
        if mine is not None:
            self.keys = tuple(mx.concatenate([a, b], axis=0) for a, b in zip(mine[0], theirs[0]))
            self.values = tuple(mx.concatenate([a, b], axis=0) for a, b in zip(mine[1], theirs[1]))
        self.left_padding = mx.concatenate([self.left_padding + (idx - self._idx), other.left_padding + (idx - other._idx)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order), dropping the padding no remaining row needs."""
        index = mx.array(keep)
        if self.keys is not None:
            self.keys = tuple(x[index] for x in self.keys)
            self.values = tuple(x[index] for x in self.values)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        shift = min(self.left_padding.tolist()) if keep else 0
        if shift > 0:
            if self.keys is not None:
                self.keys = tree_map(lambda x: x[..., shift:, :], self.keys)
                self.values = tree_map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extract(self, idx: int) -> C.QuantizedKVCache:
        """Row ``idx`` as a plain ``QuantizedKVCache`` holding exactly its tokens."""
        cache = C.QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = int(self.left_padding[idx].item())
        row = lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx, :])  # noqa: E731
        cache.keys, cache.values = tree_map(row, self.keys), tree_map(row, self.values)
        cache.offset = self._idx - pad
        return cache

    # ------------------------------------------------------------ bookkeeping

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding = v

    def is_trimmable(self):
        return False

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
