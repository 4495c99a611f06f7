"""A ``BatchKVCache`` of one sequence, made over that sequence's own K/V buffers.

mlx-lm's ``BatchKVCache.merge`` copies every row into a new buffer sized exactly to the longest, so
the first decode step grows it again: a turn decoding alone paid two copies of its whole cache to
become a batch. A batch of one needs no padding, so this one takes the row's buffers as they are,
spare slots included, and the decode writes there in place::

    KVCache            keys [t0 .. t_{n-1} | spare ]   offset n
    BatchOneKVCache    keys  (the same array)          _idx n, left_padding [0], offset [n]

Leaving is mlx-lm's ``extract``: one copy of exactly the row, evaluated while the pool takes the
blocks, one layer's buffer freed after another (a finished cache that kept its spare slots would
keep them in the pool). A second row joins through mlx-lm's ``extend`` (a copy, as before). MLX
never writes into a buffer another array still holds: while anything else holds the sequence's
old buffer, the first write copies it, which is what merge did.
"""

from __future__ import annotations

from mlx_lm.models import cache as C


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
