"""A ``BatchKVCache`` of one sequence, made over that sequence's own K/V buffers.

mlx-lm's ``BatchKVCache.merge`` copies every row into a new buffer sized exactly to the longest, so
the first decode step grows it again: a turn decoding alone paid two copies of its whole cache to
become a batch. A batch of one needs no padding, so this one takes the row's buffers as they are,
spare slots included, and the decode writes there in place::

    KVCache            keys [t0 .. t_{n-1} | spare ]   offset n
    BatchOneKVCache    keys  (the same array)          _idx n, left_padding [0], offset [n]

Leaving hands the pool the row over the same buffers when their spare slots are at most
``1/SPARE_SHARE`` of its tokens: the pool copies only the blocks it lacks (a resumed turn's new
tokens; its history's blocks are already pooled), or adopts the buffer whole (a first turn), keeping
that little spare. With more spare it is mlx-lm's ``extract``: one copy of exactly the row, evaluated
while the pool takes the blocks, one layer's buffer freed after another, so a short cache with a
256-slot growth step never keeps the step in the pool. A second row joins through mlx-lm's
``extend`` (a copy, as before). MLX never writes into a buffer another array still holds: while
anything else holds the sequence's old buffer, the first write copies it, which is what merge did.
"""

from __future__ import annotations

from mlx_lm.models import cache as C


# a leaving row keeps its buffer when the spare slots are at most this share of its tokens (1/32: 3%)
SPARE_SHARE = 32


class BatchOneKVCache(C.BatchKVCache):
    """mlx-lm's ``BatchKVCache``, made from one ``KVCache`` without a copy (module doc)."""

    @classmethod
    def wrap(cls, cache: C.KVCache) -> "BatchOneKVCache":
        """A batch of the one sequence ``cache`` holds, over its own buffers."""
        batch = cls([0])
        if cache.keys is not None and cache.offset:
            batch.keys, batch.values = cache.keys, cache.values
            batch.offset = batch.offset + cache.offset
            batch._idx = cache.offset
        return batch

    def extract(self, idx: int) -> C.KVCache:
        """Row ``idx`` as a ``KVCache``: over the same buffers when it is the only row, unpadded, with
        little spare (module doc); else mlx-lm's copy of exactly the row."""
        if self.keys is None or self.keys.shape[0] != 1 or self._idx == 0:
            return super().extract(idx)
        spare = self.keys.shape[2] - self._idx
        if int(self.left_padding[0].item()) or spare * SPARE_SHARE > self._idx:
            return super().extract(idx)
        cache = C.KVCache()
        # new array objects over the same data: the batch's own objects change at its next write
        cache.keys, cache.values, cache.offset = self.keys[...], self.values[...], self._idx
        return cache
